"""What the recipes share: preparing the task, the model and the warm start; export; validating; the report.

Every rank runs the recipe script (SPMD). Files are written by global rank 0 only, before the first
``fit`` starts the other ranks (or, under torchrun, while they wait for the files to appear), so every
rank takes the same decisions. Every directory is written under a temporary name and renamed into place
when complete; an existing one is replaced only if verl-trainer wrote it (``verl_trainer.utils.fs``).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from verl_trainer.agents import prompt_tool_schemas
from verl_trainer.algorithms.config import GRPOConfig, PPOConfig
from verl_trainer.algorithms.data import DataConfig, PromptDataModule, SFTDataModule, vision_processor
from verl_trainer.algorithms.sft import SFT, SFTConfig
from verl_trainer.callbacks import ProgressBar
from verl_trainer.data.hub import data_fingerprint
from verl_trainer.data.prompts import read_rows, save_rows
from verl_trainer.data.tasks import write_arithmetic_task
from verl_trainer.engine import BaseEngine
from verl_trainer.models.hf_dir import HF_MODEL_KINDS
from verl_trainer.models.loading import load_tokenizer
from verl_trainer.models.source import ModelNotFoundError, resolve_model_path
from verl_trainer.models.tiny import make_tiny_model
from verl_trainer.models.weight_files import check_weight_dir
from verl_trainer.module import TrainingModule
from verl_trainer.recipe_config import (
    DEMO_MODEL_PATH,
    GRPORecipeConfig,
    ModelConfig,
    PPORecipeConfig,
    SFTRecipeConfig,
    TaskConfig,
    TrainerConfig,
    WarmStartConfig,
)
from verl_trainer.recipe_config.demo_scope import apply_demo_scope
from verl_trainer.recipe_config.run_length import run_length, with_schedule_length
from verl_trainer.recipes.plotting import plot_training_curves
from verl_trainer.rollout import resolve_rollout_name, rollout_class
from verl_trainer.rollout_pool.current import is_rollout_rank
from verl_trainer.trainer import Trainer
from verl_trainer.utils.cached_dir import fingerprint, is_current, normalize, settings_difference
from verl_trainer.utils.dir_lock import DirectoryLock
from verl_trainer.utils.distributed import barrier, get_rank
from verl_trainer.utils.fs import ensure_replaceable, is_owned, mark_owned, replace_dir_atomically

RecipeConfig = SFTRecipeConfig | GRPORecipeConfig | PPORecipeConfig
"""A recipe's whole config (``configs/*.yaml`` read by ``parse_recipe_args``)."""
AlgorithmConfig = SFTConfig | GRPOConfig | PPOConfig
"""A recipe's ``algorithm`` section: what its module is built from."""
DataModule = PromptDataModule | SFTDataModule
"""The datamodules the recipes train on."""

RL_PROGRESS = ("reward/mean", "val/reward/mean", "response_length/mean", "actor/pg_loss")
WAIT_FOR_FILES_S = 600.0



def write_pair_files(task_dir: str, prefix: str, make_rows: Callable[[list[dict[str, Any]], int], Any],
                     seed: int) -> None:
    """``{prefix}_{train,val}.jsonl``: ``make_rows(rows, seed)`` of the task's ``sft_{train,val}.jsonl``.

    Each is written where missing and its source exists, by rank 0 only, atomically (a temporary file
    renamed); the demos' preference and reward-model pairs.
    """
    for split in ("train", "val"):
        out, source = Path(task_dir) / f"{prefix}_{split}.jsonl", Path(task_dir) / f"sft_{split}.jsonl"
        if out.exists() or not source.exists() or launch_rank() != 0:
            continue
        tmp = out.with_suffix(f".tmp{os.getpid()}.jsonl")
        save_rows(make_rows(read_rows(source), seed), tmp)
        os.replace(tmp, out)


def launch_rank() -> int:
    """This process's global rank before the process group exists (0 for the script you started)."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def _wait_for(path: Path, ready: Callable[[], bool] | None = None) -> None:
    """Wait until ``ready()`` (default: ``path`` exists), i.e. until rank 0 has written ``path``."""
    deadline = time.monotonic() + WAIT_FOR_FILES_S
    while not (ready() if ready is not None else path.exists()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {launch_rank()} waited {WAIT_FOR_FILES_S:.0f}s for {path} from rank 0")
        time.sleep(0.5)


def prepare_task(task: TaskConfig) -> None:
    """Write the arithmetic task's files into ``task.dir`` (rank 0) when missing or made with other settings.

    The directory's marker records the ``task.arithmetic`` settings that generated it; a directory the
    project wrote with other settings (or before settings were recorded) is rebuilt, saying why, so a
    changed ``task.arithmetic.*`` never trains on the old files. Files in a directory verl-trainer did not
    write are used as they are.
    """
    marker = Path(task.dir) / "train.jsonl"
    settings = {"arithmetic": dataclasses.asdict(task.arithmetic)}
    ours = is_owned(task.dir)
    if not task.write_if_missing or (marker.exists() and (not ours or is_current(task.dir, settings))):
        return
    if launch_rank() != 0:
        _wait_for(marker, lambda: marker.exists() and (not is_owned(task.dir)
                                                       or is_current(task.dir, settings)))
        return
    reason = settings_difference(task.dir, settings) if marker.exists() else "missing"
    # an incomplete earlier write is replaced; a directory verl-trainer did not write is refused
    replace_dir_atomically(task.dir, lambda tmp: write_arithmetic_task(tmp, task.arithmetic), "task",
                           "task.dir", settings=normalize(settings))
    print(f"wrote the arithmetic task to {task.dir} ({reason})", flush=True)


def _is_demo_path(path: str) -> bool:
    return os.path.normpath(path) == os.path.normpath(DEMO_MODEL_PATH)


def prepare_model(model: ModelConfig) -> str:
    """The initial checkpoint's local directory; fails before any work when there is none.

    ``model.path`` is a local HF directory or a hub id already in the HF cache
    (:func:`~verl_trainer.models.source.resolve_model_path`; nothing is downloaded). Only the demo makes a
    model: with ``make_tiny_if_missing`` and ``model.path`` at the demo's own path (:data:`DEMO_MODEL_PATH`)
    a tiny model is written there (rank 0) when it is missing or was made with other ``model.tiny``
    settings (a directory verl-trainer did not write is used as it is).

    Raises:
        ModelNotFoundError: Naming the path, whether it looked like a hub id, and the fix.
        DamagedWeightsError: If a ``*.safetensors`` file there is truncated, naming it.
    """
    path = Path(model.path)
    settings = {"tiny": dataclasses.asdict(model.tiny)}
    ours = is_owned(path) or not (path / "config.json").exists()
    if model.make_tiny_if_missing and _is_demo_path(model.path) and ours and not is_current(path, settings):
        if launch_rank() != 0:
            _wait_for(path, lambda: is_current(path, settings))
        else:
            reason = settings_difference(path, settings) if path.exists() else "missing"
            tiny = dataclasses.asdict(model.tiny)
            replace_dir_atomically(path, lambda tmp: make_tiny_model(tmp, **tiny), "tiny_model", "model.path",
                                   settings=normalize(settings))
            print(f"made a tiny {model.tiny.arch} model at {model.path} ({reason})", flush=True)
    try:
        local = resolve_model_path(model.path, "model.path")
    except ModelNotFoundError as exc:
        if model.make_tiny_if_missing and not _is_demo_path(model.path):
            raise ModelNotFoundError(f"{exc}. (make_tiny_if_missing makes a random tiny model only at the "
                                     f"demo's own path, model.path={DEMO_MODEL_PATH})") from None
        if _is_demo_path(model.path):
            raise ModelNotFoundError(f"{exc}. For the demo's tiny model, run `python recipes/grpo.py` once "
                                     f"(it makes one there) or add model.make_tiny_if_missing=true") from None
        raise
    check_weight_dir(local)  # a truncated weights file is named here, before any model loads
    return local


def warm_start_settings(cfg: WarmStartConfig, model_path: str, trainer_cfg: TrainerConfig) -> dict[str, Any]:
    """What a warm-start policy is a function of: its input model and data (by content) and its settings."""
    return {
        "model": fingerprint(resolve_model_path(model_path)),
        "train_files": data_fingerprint(cfg.train_files),
        "batch_size": cfg.batch_size,
        "max_steps": cfg.max_steps,
        "optim": dataclasses.asdict(cfg.optim),
        "engine": dataclasses.asdict(cfg.engine),
        "seed": trainer_cfg.seed,
    }


@dataclasses.dataclass
class Run:
    """What :func:`prepare` found and built: nothing here has loaded a model yet.

    Attributes:
        base: The initial checkpoint's local directory (``model.path`` resolved, or the demo's tiny model).
        module: The training module, its ``model_path`` the policy's start (``algorithm.model_path``, else
            the warm start's output when enabled, else ``base``).
        data: The datamodule, its files already read, tokenised and checked.
        export_dir: Where the trained model is exported as a HF directory (``None``: not exported).
        warm_start: Whether the RL policy starts from a warm start that :func:`warm_start` makes.
    """

    base: str
    module: TrainingModule
    data: DataModule
    export_dir: str | None
    warm_start: bool


def prepare(cfg: RecipeConfig, trainer: Trainer, module_cls: Callable[[AlgorithmConfig], TrainingModule],
            data_cls: type[DataModule]) -> Run:
    """Everything that can fail before a model loads, in the launching process.

    Checks the export directory, resolves the models (a missing one fails here; the demo's tiny model is
    made), writes the task files, builds the module (its own checks run: the algorithm's, the reward
    function's signature) and checks the run with :meth:`~verl_trainer.Trainer.check` (engine settings, the
    world size, the data read, tokenised and checked for the run's DP size), the data's sources against
    the reward functions (``RewardFunctions.check_data_sources``), and the warm start's data when one will
    be made. A bad setting fails in seconds, once. The demo's task, validation set and warm start apply
    only to the demo's model and data
    (:func:`~verl_trainer.recipe_config.demo_scope.apply_demo_scope`, already applied by
    ``parse_recipe_args``; applying it again changes nothing).
    """
    for note in apply_demo_scope(cfg):
        if launch_rank() == 0:
            print(f"note: {note}", flush=True)
    trainer.logging.run_config = dataclasses.asdict(cfg)  # wandb / CSV record the whole resolved config
    export_dir = final_export_dir(cfg.trainer, getattr(cfg, "export_dir", None))
    if (probe := checkpoint_lock(trainer)) is not None and launch_rank() == 0:
        probe.ensure_free()  # a second run in this directory is refused before any work (writes nothing)
    base = prepare_model(cfg.model)  # a model that is not there fails here (nothing written yet)
    lock_checkpoint_dir(trainer)  # a second run in this directory is refused before it writes its own
    explicit = resolve_algorithm_model(cfg.algorithm.model_path)
    prepare_task(cfg.task)
    warm = getattr(cfg, "warm_start", None)
    warm = warm if warm is not None and warm.enable and not explicit else None
    policy = explicit or (warm.output if warm is not None else base)
    module = module_cls(dataclasses.replace(cfg.algorithm, model_path=policy))
    rollout = getattr(cfg.algorithm, "rollout", None)
    backend = None if rollout is None else resolve_rollout_name(rollout, explicit or base)
    if backend is not None:  # before any model
        rollout_class(backend).check(rollout, explicit or base)
    if backend is not None and (ignored := rollout.ignored_by(backend)) and launch_rank() == 0:
        names = ", ".join(f"algorithm.rollout.{setting}" for setting in ignored)
        print(f"note: the {backend} rollout does not read {names} (settings of the other backend; "
              f"algorithm.rollout.name={rollout.name})", flush=True)
    tools = prompt_tool_schemas(rollout.multi_turn) if rollout is not None else None
    extra = {"tools": tools} if tools else {}
    if (processor := vision_processor(explicit or base)) is not None:  # a vision-language policy
        extra["processor"] = processor
    data = data_cls(cfg.data, load_tokenizer(explicit or base), **extra)
    dp_size = trainer.check(module, datamodule=data)
    if cfg.trainer.max_epochs is not None:  # the epochs' step count, as verl counts it
        module = module_cls(_set_run_length(cfg, trainer, module.config, data.batches_per_epoch(dp_size)))
    reward_fn, sources = getattr(module, "reward_fn", None), getattr(data, "data_sources", None)
    if reward_fn is not None and sources is not None:  # e.g. default_compute_score and an unknown source
        reward_fn.check_data_sources(sources())
    if warm is not None and not is_current(warm.output, warm_start_settings(warm, base, cfg.trainer)):
        ensure_replaceable(warm.output, "warm_start.output", HF_MODEL_KINDS)  # before training, not after
        try:
            trainer.check(*_warm_start_run(warm, base))
        except (ValueError, FileNotFoundError) as err:
            raise type(err)(f"warm_start: {err} (there, data.train_files is warm_start.train_files and "
                            "data.train_batch_size is warm_start.batch_size)") from None
    return Run(base, module, data, export_dir, warm is not None)


def _set_run_length(cfg: RecipeConfig, trainer: Trainer, algorithm: AlgorithmConfig,
                    batches_per_epoch: int) -> AlgorithmConfig:
    """Set ``trainer.max_steps`` from the epochs (:mod:`verl_trainer.recipe_config.run_length`); returns
    ``algorithm`` with the schedules that followed the run's length spanning it. Printed once."""
    t = cfg.trainer
    steps, how = run_length(t.max_steps, t.max_epochs, batches_per_epoch, t.accumulate_grad_batches,
                            t.limit_train_batches)
    trainer.max_steps = steps
    algorithm, paths = with_schedule_length(algorithm, t.max_steps, steps)
    if launch_rank() == 0:
        spans = f"; the lr schedule of {', '.join(f'algorithm.{p}' for p in paths)} spans it" if paths else ""
        print(f"{how}{spans}", flush=True)
    return algorithm


def lock_checkpoint_dir(trainer: Trainer) -> DirectoryLock | None:
    """Lock the run's checkpoint directory now, in the launching process (rank 0), until the script ends.

    ``ModelCheckpoint`` locks it for the fit (``verl_trainer/utils/dir_lock.py``); taking it here first
    refuses a second run started in the same directory before it makes the task, the warm start or loads a
    model. Released when the process exits normally (a killed one leaves a stale lock the next run reports).

    Raises:
        DirectoryLockedError: If another run holds the directory.
    """
    lock = checkpoint_lock(trainer) if launch_rank() == 0 else None
    if lock is None:
        return None
    lock.acquire()
    atexit.register(lock.release)
    if lock.stale_message() is not None:
        print(lock.stale_message(), flush=True)
    return lock


def checkpoint_lock(trainer: Trainer) -> DirectoryLock | None:
    """The (not yet taken) lock of the run's checkpoint directory; ``None`` without checkpointing."""
    ckpt = trainer.checkpoint_callback
    if ckpt is None:
        return None
    dirpath = ckpt.dirpath if ckpt.dirpath is not None else Path(trainer.default_root_dir) / "checkpoints"
    return DirectoryLock(dirpath, "checkpoint directory")


def _warm_start_run(cfg: WarmStartConfig, model_path: str) -> tuple[SFT, SFTDataModule]:
    module = SFT(SFTConfig(model_path=model_path, engine=cfg.engine, optim=cfg.optim))
    data_cfg = DataConfig(train_files=cfg.train_files, train_batch_size=cfg.batch_size, val_files=None)
    return module, SFTDataModule(data_cfg, load_tokenizer(model_path), processor=vision_processor(model_path))


def warm_start(cfg: WarmStartConfig, model_path: str, trainer_cfg: TrainerConfig) -> str:
    """A short SFT of ``model_path``; returns the policy's path.

    ``cfg.output`` is reused when it records the same settings, input model and data
    (:func:`warm_start_settings`); otherwise it is rebuilt (saying why) — replaced only if verl-trainer
    wrote it.
    """
    if not cfg.enable:
        return model_path
    ensure_replaceable(cfg.output, "warm_start.output", HF_MODEL_KINDS)  # before training, not after
    settings = warm_start_settings(cfg, model_path, trainer_cfg)
    if is_current(cfg.output, settings):
        return cfg.output
    if Path(cfg.output).exists() and launch_rank() == 0:
        print(f"rebuilding the warm start at {cfg.output}: {settings_difference(cfg.output, settings)}",
              flush=True)
    module, data = _warm_start_run(cfg, model_path)
    trainer = trainer_cfg.build(
        callbacks=[ProgressBar(metrics=("sft/loss",), refresh_rate=10)], max_steps=cfg.max_steps,
        max_epochs=None, logger=False, val_check_interval=None, enable_checkpointing=False,
        default_root_dir=str(Path(trainer_cfg.default_root_dir) / "warm_start"),
    )
    trainer.fit(module, datamodule=data)
    export_policy(module.engines["actor"], cfg.output, "warm_start", settings=normalize(settings))
    if trainer.is_global_zero:
        loss = trainer.callback_metrics.get("sft/loss", float("nan"))
        print(f"SFT warm start: {cfg.max_steps} steps, loss {loss:.3f} -> {cfg.output}", flush=True)
    module.engines.clear()
    return cfg.output


def final_export_dir(trainer_cfg: TrainerConfig, explicit: str | None = None) -> str | None:
    """Where a recipe exports its trained policy (``None``: no export), checked before any work.

    ``explicit``, else ``<default_root_dir>/hf`` when ``trainer.export_hf``. It must be new, empty or a
    directory verl-trainer wrote.
    """
    out = explicit or (str(Path(trainer_cfg.default_root_dir) / "hf") if trainer_cfg.export_hf else None)
    if out is not None:
        ensure_replaceable(out, "export_dir" if explicit else "trainer.default_root_dir/hf", HF_MODEL_KINDS)
    return out


def resolve_algorithm_model(path: str) -> str:
    """``algorithm.model_path`` resolved (empty stays empty), so a missing model fails before any work."""
    return resolve_model_path(path, "algorithm.model_path") if path else ""


def export_policy(engine: BaseEngine, out_dir: str | os.PathLike, kind: str = "hf_export",
                  dtype: torch.dtype | None = None, **details: object) -> str:
    """``engine.save_hf(out_dir, dtype=dtype)`` (a collective); rank 0 then records ``kind`` and ``details``
    in its marker.

    ``engine`` is the module's engine, still initialised (``module.engines["actor"]``); the tokenizer is
    its model path's. ``dtype``: the weights' dtype (``TrainerConfig.export_torch_dtype()``; ``None``: as
    stored).
    """
    engine.save_hf(out_dir, dtype=dtype)
    if get_rank() == 0 and (kind != "hf_export" or details):
        mark_owned(out_dir, kind, **details)
    barrier()
    return str(out_dir)


def validate(trainer: Trainer, module: TrainingModule, data: DataModule) -> dict[str, float]:
    """``trainer.validate`` once; its reduced metrics (the same on every rank); ``{}`` without
    ``data.val_files``; ``{}`` on a separate pool's rollout rank (it validates nothing)."""
    if not data.config.val_files:
        return {}
    results = trainer.validate(module, datamodule=data)
    return {} if is_rollout_rank() else dict(results[0])


def validate_after_fit(trainer: Trainer, module: TrainingModule, data: DataModule) -> dict[str, float]:
    """The "after training" validation: the one ``fit`` ran at its last step when there was one (its
    schedule hit the last step: the same weights, so no second pass), else one ``trainer.validate``; ``{}``
    without ``data.val_files``."""
    if not data.config.val_files:
        return {}
    last = trainer.last_validation
    if last is not None and last[0] == trainer.global_step:
        return dict(last[1])
    return validate(trainer, module, data)


def _csv_path(trainer: Trainer) -> Path | None:
    from lightning.pytorch.loggers import CSVLogger

    for lg in trainer.loggers:
        if isinstance(lg, CSVLogger):
            return Path(lg.log_dir) / "metrics.csv"
    return None


def _mlflow_stores(trainer: Trainer) -> list[str]:
    """The tracking URIs of the run's MLflow loggers."""
    from lightning.pytorch.loggers import MLFlowLogger

    return [lg._tracking_uri for lg in trainer.loggers if isinstance(lg, MLFlowLogger) and lg._tracking_uri]


def report(trainer: Trainer, before: dict[str, float] | None, after: dict[str, float], keys: tuple[str, ...],
           plot: bool = True, started: float | None = None, exported: str | None = None) -> None:
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
            lines.append(f"plot:      {plot_training_curves(csv_path)}")
    if exported:
        vlm = vision_processor(exported) is not None
        auto = "AutoModelForImageTextToText" if vlm else "AutoModelForCausalLM"
        lines.append(f"HF model:  {exported}  ({auto}.from_pretrained loads it)")
    for uri in _mlflow_stores(trainer):
        lines.append(f"MLflow:    {uri}  (`mlflow ui --backend-store-uri {uri}` shows it)")
    runs = sorted((Path(trainer.default_root_dir) / "wandb").glob("offline-run-*"), key=os.path.getmtime)
    if runs:
        lines.append(f"wandb run: {runs[-1]}  (offline; `wandb sync` uploads it)")
    lines.append("=" * 72)
    print("\n".join(lines), flush=True)
