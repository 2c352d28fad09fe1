"""The fit and validation loops of :class:`verl_trainer.Trainer`, and checkpoint save/restore.

Hook order of ``fit`` (pinned by ``tests/trainer/test_hooks.py``)::

    setup(stage) → [on_load_checkpoint] → on_fit_start → on_train_start
    per step:  on_train_batch_start → training_step (the module dispatches on_rollout_end,
               on_before_update, on_before_backward per micro-batch, on_after_backward,
               on_before_optimizer_step) → LR schedulers step → global_step += 1 → on_train_batch_end
               → metrics logged → [validation: on_validation_start → (on_validation_batch_start →
               validation_step → on_validation_batch_end)* → on_validation_end]
    on_train_end → on_fit_end → teardown(stage)

``on_save_checkpoint`` runs inside a checkpoint save (``ModelCheckpoint`` saves in
``on_train_batch_end``, in ``on_validation_end`` when validation runs that step, and in
``on_train_end``). ``on_exception`` runs when the stage raises, before ``teardown``.
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from verl_trainer.training import checkpoint as ckpt
from verl_trainer.training import resume_check
from verl_trainer.training.data import ShardedLoader, as_dataloader
from verl_trainer.utils.distributed import barrier, broadcast_object

if TYPE_CHECKING:
    from verl_trainer.module import TrainingModule
    from verl_trainer.trainer import Trainer

STATE_VERSION = 1


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and torch (CPU and CUDA) identically on every rank."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def configure_engines(trainer: Trainer, module: TrainingModule) -> None:
    """Build and initialise the module's engines with the strategy (on its one topology), once per module."""
    if module.engines:
        return
    module.engines = trainer.strategy.build_engines(
        module.configure_engines(), trainer.precision, trainer.seed, trainer.accelerator
    )


def _loader(trainer: Trainer, kind: str, datamodule: Any, module: Any) -> ShardedLoader | None:
    method = f"{kind}_dataloader"
    source = None
    if datamodule is not None:
        if callable(getattr(datamodule, method, None)):
            source = getattr(datamodule, method)()
        elif kind == "train":
            source = datamodule
    elif callable(getattr(module, method, None)):
        source = getattr(module, method)()
    if source is None:
        return None
    loader = as_dataloader(source, f"{kind} data")
    return ShardedLoader(loader, trainer.dp_rank, trainer.dp_size, trainer.seed, tag_padding=kind == "val")


def run_stage(trainer: Trainer, stage: str, module: Any, datamodule: Any, ckpt_path: Any) -> Any:
    """Set everything up for ``stage`` (``"fit"`` / ``"validate"``) on this rank and run it."""
    trainer.module, trainer.state, trainer.should_stop = module, stage, False
    module.trainer = trainer
    if datamodule is not None and hasattr(datamodule, "trainer"):
        datamodule.trainer = trainer  # Lightning's attribute: the datamodule reads trainer.dp_size
    seed_everything(trainer.seed)
    trainer.logging.setup(trainer.is_global_zero)
    status = "failed"
    try:
        trainer.call_hook("setup", stage)
        module.setup(stage)
        resume = _check_resume(trainer, ckpt_path) if ckpt_path is not None else None  # before any engine
        configure_engines(trainer, module)
        trainer.train_loader = _loader(trainer, "train", datamodule, module) if stage == "fit" else None
        trainer.val_loader = _loader(trainer, "val", datamodule, module)
        if stage == "fit" and trainer.train_loader is None:
            raise ValueError("fit needs training data: pass a datamodule or define module.train_dataloader()")
        if ckpt_path is not None:
            restore(trainer, ckpt_path, resume)
        if stage == "fit":
            result = fit_loop(trainer)
        else:
            if trainer.val_loader is None:
                raise ValueError("validate needs validation data: a datamodule with val_dataloader()")
            result = [validation_loop(trainer)]
        status = "success"
        return result
    except BaseException as exc:
        trainer.call_hook("on_exception", exc)
        raise
    finally:
        trainer.call_hook("teardown", stage)
        trainer.logging.finalize(status)
        if status == "success":
            barrier()
        trainer.state = None


def _max_epochs_reached(trainer: Trainer) -> bool:
    return trainer.max_epochs is not None and trainer.train_loader.epoch >= trainer.max_epochs


def _steps_done(trainer: Trainer) -> bool:
    reached = 0 < trainer.max_steps <= trainer.global_step
    return trainer.should_stop or reached or _max_epochs_reached(trainer)


def _trainable(trainer: Trainer) -> list[Any]:
    return [e for e in trainer.module.engines.values() if getattr(e, "optimizer", None) is not None]


def fit_loop(trainer: Trainer) -> None:
    """Run training steps until ``max_steps`` / ``max_epochs`` / ``trainer.should_stop``."""
    module, loader = trainer.module, trainer.train_loader
    trainer.logging.setup(trainer.is_global_zero, module.hparams)
    trainer.call_hook("on_fit_start")
    trainer.call_hook("on_train_start")
    while not _steps_done(trainer):
        ran = 0
        for batch in loader.epoch_batches():
            batch_idx = loader.batches
            trainer.call_hook("on_train_batch_start", batch, batch_idx)
            outputs = module.training_step(batch, batch_idx)
            for engine in _trainable(trainer):
                engine.lr_scheduler_step()
            trainer.global_step += 1
            loader.advance()
            ran += 1
            trainer.call_hook("on_train_batch_end", outputs, batch, batch_idx)
            trainer.flush_metrics()
            if trainer.validation_due():
                validation_loop(trainer)
            if _steps_done(trainer):
                break
        else:
            if ran == 0 and loader.batches == 0:
                raise ValueError(f"the training data yields no batch on dp rank {trainer.dp_rank}")
            loader.next_epoch()
    trainer.call_hook("on_train_end")
    trainer.call_hook("on_fit_end")
    trainer.flush_metrics(force=True)


def validation_loop(trainer: Trainer) -> dict[str, float]:
    """Run every validation batch once; returns the values logged for it."""
    module, loader = trainer.module, trainer.val_loader
    loader.epoch, loader.batches = 0, 0
    trainer.flush_metrics()
    trainer.call_hook("on_validation_start")
    with torch.no_grad():
        for batch_idx, batch in enumerate(loader.epoch_batches()):
            trainer.call_hook("on_validation_batch_start", batch, batch_idx)
            outputs = module.validation_step(batch, batch_idx)
            trainer.call_hook("on_validation_batch_end", outputs, batch, batch_idx)
    trainer.call_hook("on_validation_end")
    values = trainer.logging.pending()
    trainer.flush_metrics(force=True)
    return values


# ---------------------------------------------------------------------------------------- checkpoints
def save_checkpoint(trainer: Trainer, path: Path) -> None:
    """Write a checkpoint of the whole run to ``path`` (collective; see ``training/checkpoint.py``)."""
    trainer.flush_metrics()
    trainer.logging.save()

    def make_state() -> dict[str, Any]:
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            "global_step": trainer.global_step,
            "data": trainer.train_loader.state_dict() if trainer.train_loader is not None else None,
            "module": trainer.module.state_dict(),
            "callbacks": {cb.state_key: cb.state_dict() for cb in trainer.callbacks},
        }
        trainer.call_hook("on_save_checkpoint", state)
        return state

    meta = {
        "global_step": trainer.global_step,
        "run_id": getattr(trainer.checkpoint_callback, "run_id", None),
        **resume_check.run_metadata(trainer),  # what a resume is checked against
    }
    ckpt.write_checkpoint(path, trainer.module.engines, make_state, meta, trainer.global_step)


def _resolve(trainer: Trainer, ckpt_path: Any) -> Path | None:
    if str(ckpt_path) != "last":
        path = Path(ckpt_path)
        if not (path / ckpt.STATE_FILE).is_file():
            raise FileNotFoundError(f"ckpt_path={str(ckpt_path)!r} is not a complete checkpoint directory")
        return path
    found = broadcast_object(str(ckpt.find_last_checkpoint(trainer.checkpoint_dir) or ""))  # rank 0's choice
    return Path(found) if found else None


def _check_resume(trainer: Trainer, ckpt_path: Any) -> tuple[Path, dict[str, Any]] | None:
    """Resolve ``ckpt_path`` and check the run's settings against the checkpoint's, before any engine.

    Every rank reads the same ``meta.json`` and raises the same
    :class:`~verl_trainer.training.resume_check.ResumeMismatchError` together. The differences that
    apply are printed on rank 0 and kept in ``trainer.resume_changes``.

    Returns:
        ``(checkpoint directory, its meta.json)``, or ``None`` when ``"last"`` found no checkpoint.
    """
    path = _resolve(trainer, ckpt_path)
    if path is None:
        return None
    meta = resume_check.read_meta(path)
    trainer.resume_changes = resume_check.check_run_settings(trainer, path, meta)
    if trainer.resume_changes and trainer.is_global_zero:
        listed = "\n  ".join(trainer.resume_changes)
        print(f"resuming from {path}; changed since the checkpoint (these apply):\n  {listed}", flush=True)
    return path, meta


def restore(trainer: Trainer, ckpt_path: Any, resume: tuple[Path, dict[str, Any]] | None = None) -> None:
    """Restore engines, trainer state, data position, module and callback states, then RNG.

    ``resume``: what :func:`_check_resume` returned (resolved and checked here when not given). The
    engines' models are checked against the checkpoint's before anything is loaded, and every engine's
    optimizer and schedule follow the current config after it (``apply_optim_config``).
    """
    if resume is None:
        resume = _check_resume(trainer, ckpt_path)
    if resume is None:
        if trainer.is_global_zero:
            warnings.warn(
                f"ckpt_path='last' found no complete checkpoint in {str(trainer.checkpoint_dir)!r}; "
                f"starting from scratch", stacklevel=2,
            )
        return
    path, meta = resume
    resume_check.check_models(path, meta, trainer.module.engines)
    ckpt.load_engines(path, trainer.module.engines)
    for engine in _trainable(trainer):
        engine.apply_optim_config()  # a changed lr / schedule applies (the checkpoint restored the old)
    state = ckpt.load_state(path)
    trainer.global_step = int(state["global_step"])
    if trainer.train_loader is not None and state.get("data") is not None:
        trainer.train_loader.load_state_dict(state["data"])
    trainer.module.load_state_dict(state.get("module") or {})
    saved = state.get("callbacks") or {}
    for cb in trainer.callbacks:
        if cb.state_key in saved:
            cb.load_state_dict(saved[cb.state_key])
    trainer.call_hook("on_load_checkpoint", state)
    ckpt.load_rng(path)
