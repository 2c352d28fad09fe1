"""What the recipes share: preparing the task, the model and the warm start; validating; the report.

Every rank runs the recipe script (SPMD). Files are written by global rank 0 only, before the first
``fit`` starts the other ranks (or, under torchrun, while they wait for the files to appear), so every
rank takes the same decisions. Every directory is written under a temporary name and renamed into place
when complete; an existing one is replaced only if verl-trainer wrote it (``verl_trainer.utils.fs``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

from verl_trainer.algorithms.data import DataConfig, SFTDataModule
from verl_trainer.algorithms.sft import SFT, SFTConfig
from verl_trainer.callbacks import ProgressBar
from verl_trainer.configs import ModelConfig, TaskConfig, TrainerConfig, WarmStartConfig
from verl_trainer.data.tasks import write_arithmetic_task
from verl_trainer.models.loading import load_causal_lm, load_tokenizer
from verl_trainer.models.tiny import make_tiny_model
from verl_trainer.utils.distributed import barrier, get_rank
from verl_trainer.utils.fs import ensure_replaceable, replace_dir_atomically

RL_PROGRESS = ("reward/mean", "val/reward/mean", "response_length/mean", "actor/pg_loss")
WAIT_FOR_FILES_S = 600.0


def launch_rank() -> int:
    """This process's global rank before the process group exists (0 for the script you started)."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_FOR_FILES_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {launch_rank()} waited {WAIT_FOR_FILES_S:.0f}s for {path} from rank 0")
        time.sleep(0.5)


def prepare_task(task: TaskConfig) -> None:
    """Write the arithmetic task's files into ``task.dir`` when they are missing (rank 0)."""
    marker = Path(task.dir) / "train.jsonl"
    if marker.exists() or not task.write_if_missing:
        return
    if launch_rank() != 0:
        _wait_for(marker)
        return
    # an incomplete earlier write is replaced; a directory verl-trainer did not write is refused
    replace_dir_atomically(task.dir, lambda tmp: write_arithmetic_task(tmp, task.arithmetic), "task",
                           "task.dir")
    print(f"wrote the arithmetic task to {task.dir}", flush=True)


def prepare_model(model: ModelConfig) -> str:
    """The initial checkpoint: ``model.path``, where a tiny model is made first when it is missing."""
    marker = Path(model.path) / "config.json"
    if marker.exists() or not model.make_tiny_if_missing:
        return model.path
    if launch_rank() != 0:
        _wait_for(marker)
        return model.path
    tiny = dataclasses.asdict(model.tiny)
    replace_dir_atomically(model.path, lambda tmp: make_tiny_model(tmp, **tiny), "tiny_model", "model.path")
    print(f"made a tiny {model.tiny.arch} model at {model.path}", flush=True)
    return model.path


def export_hf_model(engine: Any, source_path: str, out_dir: str | os.PathLike, what: str = "export_dir"
                    ) -> str:
    """Write ``engine``'s weights as a HF checkpoint (the architecture and tokenizer of ``source_path``).

    A collective (``get_per_tensor_param``): call it on every rank; rank 0 writes, every rank returns
    once the directory is complete. ``out_dir`` is written under a temporary name and replaces an
    existing directory only if verl-trainer wrote it (:func:`~verl_trainer.utils.fs.replace_dir_atomically`).

    Raises:
        NotOwnedError: On every rank, before any work, if ``out_dir`` holds files verl-trainer did not
            write (``what`` names the setting in the message).
    """
    ensure_replaceable(out_dir, what)
    params = {name: tensor.detach().cpu().clone() for name, tensor in engine.get_per_tensor_param()}
    if get_rank() == 0:
        def write(tmp: Path) -> None:
            model = load_causal_lm(source_path)
            model.load_state_dict(params, strict=True)
            model.save_pretrained(tmp)
            load_tokenizer(source_path).save_pretrained(tmp)

        replace_dir_atomically(out_dir, write, "hf_export", what)
    barrier()
    return str(out_dir)


def policy_path(cfg: Any) -> str:
    """The RL policy's initial checkpoint: ``algorithm.model_path``, else the warm start's output (when it
    is enabled), else ``model.path``."""
    warm = getattr(cfg, "warm_start", None)
    return cfg.algorithm.model_path or (warm.output if warm is not None and warm.enable else cfg.model.path)


def prepare(cfg: Any, trainer: Any, module: Any, data_cls: type) -> Any:
    """Everything that can fail before a model loads, in the launching process; returns the datamodule.

    Writes the task files and the demo model when configured, then checks the run
    (:meth:`~verl_trainer.Trainer.check`: engine settings, the world size, and the data read, tokenised and
    checked for the run's DP size) and the warm start's data, so that a bad setting fails in seconds.
    """
    prepare_task(cfg.task)
    base = cfg.algorithm.model_path or prepare_model(cfg.model)
    data = data_cls(cfg.data, load_tokenizer(base))
    trainer.check(module, datamodule=data)
    warm = getattr(cfg, "warm_start", None)
    if warm is not None and warm.enable and not (Path(warm.output) / "config.json").exists():
        ensure_replaceable(warm.output, "warm_start.output")  # before training, not after
        try:
            trainer.check(*_warm_start_run(warm, base))
        except (ValueError, FileNotFoundError) as err:
            raise type(err)(f"warm_start: {err} (there, data.train_files is warm_start.train_files and "
                            "data.train_batch_size is warm_start.batch_size)") from None
    return data


def _warm_start_run(cfg: WarmStartConfig, model_path: str) -> tuple[SFT, SFTDataModule]:
    module = SFT(SFTConfig(model_path=model_path, engine=cfg.engine, optim=cfg.optim))
    data_cfg = DataConfig(train_files=cfg.train_files, train_batch_size=cfg.batch_size, val_files=None)
    return module, SFTDataModule(data_cfg, load_tokenizer(model_path))


def warm_start(cfg: WarmStartConfig, model_path: str, trainer_cfg: TrainerConfig) -> str:
    """A short SFT of ``model_path`` (skipped when ``cfg.output`` exists); returns the policy's path."""
    if not cfg.enable:
        return model_path
    if (Path(cfg.output) / "config.json").exists():
        return cfg.output
    ensure_replaceable(cfg.output, "warm_start.output")  # before training, not after
    module, data = _warm_start_run(cfg, model_path)
    trainer = trainer_cfg.build(
        callbacks=[ProgressBar(metrics=("sft/loss",), refresh_rate=10)], max_steps=cfg.max_steps,
        max_epochs=None, logger=False, val_check_interval=None, enable_checkpointing=False,
        default_root_dir=str(Path(trainer_cfg.default_root_dir) / "warm_start"),
    )
    trainer.fit(module, datamodule=data)
    export_hf_model(module.engines["actor"], model_path, cfg.output, "warm_start.output")
    if trainer.is_global_zero:
        loss = trainer.callback_metrics.get("sft/loss", float("nan"))
        print(f"SFT warm start: {cfg.max_steps} steps, loss {loss:.3f} -> {cfg.output}", flush=True)
    module.engines.clear()
    return cfg.output


def validate(trainer: Any, module: Any, data: Any) -> dict[str, float]:
    """``trainer.validate`` once; its reduced metrics (the same on every rank); ``{}`` without
    ``data.val_files``."""
    if not data.config.val_files:
        return {}
    return dict(trainer.validate(module, datamodule=data)[0])


def _csv_path(trainer: Any) -> Path | None:
    from lightning.pytorch.loggers import CSVLogger

    for lg in trainer.loggers:
        if isinstance(lg, CSVLogger):
            return Path(lg.log_dir) / "metrics.csv"
    return None


def report(trainer: Any, before: dict[str, float] | None, after: dict[str, float], keys: tuple[str, ...],
           plot: bool = True, started: float | None = None) -> None:
    """Print before/after validation values, write the PNG next to the CSV, list the outputs (rank 0)."""
    if not trainer.is_global_zero:
        return
    lines = ["", "=" * 72]
    if started is not None:
        lines.append(f"wall time: {time.monotonic() - started:.0f} s for {trainer.global_step} steps")
    for key in keys:
        old = f"{before[key]:.4f}" if before and key in before else "n/a"
        new = f"{after[key]:.4f}" if key in after else "n/a"
        lines.append(f"{key:<28} before training: {old:>8}   after training: {new:>8}")
    csv_path = _csv_path(trainer)
    if csv_path is not None and csv_path.exists():
        lines.append(f"CSV log:   {csv_path}")
        if plot:
            from verl_trainer.plotting import plot_training_curves

            lines.append(f"plot:      {plot_training_curves(csv_path)}")
    runs = sorted((Path(trainer.default_root_dir) / "wandb").glob("offline-run-*"), key=os.path.getmtime)
    if runs:
        lines.append(f"wandb run: {runs[-1]}  (offline; `wandb sync` uploads it)")
    lines.append("=" * 72)
    print("\n".join(lines), flush=True)
