"""The fit loop of :class:`verl_trainer.Trainer`, stage set-up, and checkpoint save/restore.

Hook order of ``fit`` (pinned by ``tests/trainer/test_hooks.py``; validation, test and predict loops are in
``training/evaluation.py``)::

    setup(stage) → [on_load_checkpoint] → on_fit_start → [on_sanity_check_start → validation of
    num_sanity_val_steps batches → on_sanity_check_end] → on_train_start
    per epoch: on_train_epoch_start → steps → on_train_epoch_end
    per step:  on_train_batch_start → training_step (the module dispatches on_rollout_end,
               on_before_update, on_before_backward per micro-batch, on_after_backward,
               on_before_optimizer_step) → LR schedulers step → global_step += 1 → the step's outputs
               reduced (over ``MetricReduction``'s group) → on_train_batch_end → metrics logged →
               [validation: on_validation_start → on_validation_epoch_start →
               (on_validation_batch_start → validation_step → on_validation_batch_end)* →
               on_validation_epoch_end → on_validation_end]
    (inside train_batch, before the micro-batches: on_before_zero_grad)
    on_train_end → on_fit_end → teardown(stage)

``on_save_checkpoint`` runs inside a checkpoint save (``ModelCheckpoint`` saves in
``on_train_batch_end``, in ``on_validation_end`` when validation runs that step, and in
``on_train_end``). ``on_exception`` runs when the stage raises, before ``teardown``.

``accumulate_grad_batches=K`` joins K consecutive loader batches into the batch of one optimizer step
(``data/schema.py: concat_batches``) before ``training_step``: the engine then computes the global
denominators (tokens, samples) over all K batches, splits the joined batch into its micro-batches
(``micro_batch_size_per_gpu`` or the token budget) and steps once. So the loss and gradient equal one
step on a K-times larger batch exactly, which summing K separately normalised backward passes would
not (token-mean over K batches of different token counts). ``global_step`` counts optimizer steps.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from verl_trainer.callbacks.base import HOOK_NAMES, unknown_hooks
from verl_trainer.data.schema import concat_batches
from verl_trainer.engine.checkpoint_dirs import STATE_FILE, find_last_checkpoint
from verl_trainer.engine.config import EngineSpec
from verl_trainer.training import checkpoint as ckpt
from verl_trainer.training import evaluation, resume_check
from verl_trainer.training.data import ShardedLoader, as_dataloader, make_sharded_loader
from verl_trainer.training.evaluation import EVAL_STAGES
from verl_trainer.training.stage_data import is_datamodule
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
    """Build and initialise the module's engines with the strategy (on its one topology), once per module.

    The module gets the run's topology with them (``module.topology``).
    """
    if not module.engines:
        _build_engines(trainer, module)
    module.topology = trainer.strategy.topology or module.topology


def _build_engines(trainer: Trainer, module: TrainingModule) -> None:
    specs = dict(module.configure_engines())
    if trainer.gradient_clip_val is not None:  # Trainer(gradient_clip_val=) overrides OptimConfig.clip_grad
        clip = trainer.gradient_clip_val
        specs = {name: dataclasses.replace(spec, optim=spec.optim.replace(clip_grad=clip))
                 if isinstance(spec, EngineSpec) and spec.optim is not None else spec
                 for name, spec in specs.items()}
    module.engines = trainer.strategy.build_engines(
        specs, trainer.precision, trainer.seed, trainer.accelerator
    )


def _loader(trainer: Trainer, kind: str, datamodule: Any, module: Any, direct: bool) -> ShardedLoader | None:
    """The ``kind`` data; ``direct``: a loader / dataset passed in place of a datamodule is this data."""
    method = f"{kind}_dataloader"
    source = None
    if datamodule is not None:
        if callable(getattr(datamodule, method, None)):
            source = getattr(datamodule, method)()
        elif direct and not is_datamodule(datamodule):
            source = datamodule
    elif callable(getattr(module, method, None)):
        source = getattr(module, method)()
    if source is None:
        return None
    loader = as_dataloader(source, f"{kind} data")
    return make_sharded_loader(loader, trainer.dp_rank, trainer.dp_size, trainer.seed,
                               tag_padding=kind in ("val", "test"), limit=trainer.limits[kind])


def apply_deterministic(setting: bool | str) -> None:
    """``Trainer(deterministic=)``: deterministic torch kernels (``"warn"``: warn where there are none)."""
    if setting:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=setting == "warn")


def run_stage(trainer: Trainer, stage: str, module: Any, datamodule: Any, ckpt_path: Any) -> Any:
    """Set up ``stage`` (``fit`` / ``validate`` / ``test`` / ``predict``) on this rank and run it."""
    trainer.module, trainer.state, trainer.should_stop = module, stage, False
    trainer.datamodule = datamodule  # Lightning's attribute; its fingerprint goes into checkpoints
    module.trainer = trainer
    if datamodule is not None and hasattr(datamodule, "trainer"):
        datamodule.trainer = trainer  # Lightning's attribute: the datamodule reads trainer.dp_size
    trainer.step_hooks = trainer.callback_step_hooks()  # the callbacks may have changed since construction
    seed_everything(trainer.seed)
    apply_deterministic(trainer.deterministic)
    trainer.logging.setup(trainer.is_global_zero, getattr(module, "hparams", None))  # fit logs the same
    status = "failed"
    try:
        if stage == "fit" and datamodule is not None and callable(getattr(module, "check_data", None)):
            module.check_data(datamodule)  # settings only: every rank raises alike, before any model loads
        trainer.call_hook("setup", stage)
        module.setup(stage)
        resume = _check_resume(trainer, ckpt_path) if ckpt_path is not None else None  # before any engine
        configure_engines(trainer, module)
        fit, has_val, evaluates = stage == "fit", stage in ("fit", "validate"), stage in EVAL_STAGES
        trainer.train_loader = _loader(trainer, "train", datamodule, module, direct=True) if fit else None
        trainer.val_loader = _loader(trainer, "val", datamodule, module, direct=not fit) if has_val else None
        trainer.eval_loader = _loader(trainer, stage, datamodule, module, direct=True) if evaluates else None
        if stage == "fit" and trainer.train_loader is None:
            raise ValueError("fit needs training data: pass a datamodule or define module.train_dataloader()")
        if ckpt_path is not None:
            restore(trainer, ckpt_path, resume)
        if stage == "fit":
            result = fit_loop(trainer)
        elif stage == "validate":
            if trainer.val_loader is None:
                raise ValueError("validate needs validation data: a datamodule with val_dataloader()")
            result = [evaluation.validation_loop(trainer)]
        else:
            result = evaluation.run_eval_stage(trainer, stage)
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


def _stop_allowed(trainer: Trainer) -> bool:
    """A stop request (``should_stop``, ``max_time``) is honoured after ``min_steps`` / ``min_epochs``."""
    steps_ok = trainer.min_steps is None or trainer.global_step >= trainer.min_steps
    epochs_ok = trainer.min_epochs is None or trainer.train_loader.epoch >= trainer.min_epochs
    return steps_ok and epochs_ok


def _steps_done(trainer: Trainer) -> bool:
    reached = 0 < trainer.max_steps <= trainer.global_step
    return (trainer.should_stop and _stop_allowed(trainer)) or reached or _max_epochs_reached(trainer)


def _trainable(trainer: Trainer) -> list[Any]:
    return [e for e in trainer.module.engines.values() if getattr(e, "optimizer", None) is not None]


def _check_time(trainer: Trainer, started: float) -> None:
    """Stop when ``max_time`` has passed (rank 0's clock decides for every rank: one broadcast)."""
    if trainer.max_time is None:
        return
    if broadcast_object(time.monotonic() - started >= trainer.max_time.total_seconds()):
        trainer.should_stop = True


def _step_batches(trainer: Trainer, loader: ShardedLoader) -> Any:
    """Yield ``(batch, batch_idx)`` per optimizer step: ``accumulate_grad_batches`` loader batches joined.

    ``batch_idx`` is the index of the step's last loader batch in the epoch; the loader position
    advances by every batch taken. The last step of an epoch may join fewer batches (as in Lightning).
    """
    group: list[Any] = []
    for batch in loader.epoch_batches():
        group.append(batch)
        loader.advance()
        if len(group) == trainer.accumulate_grad_batches or loader.exhausted():
            yield (group[0] if len(group) == 1 else concat_batches(group)), loader.batches - 1
            group = []
    if group:
        yield concat_batches(group), loader.batches - 1


def peek_next_step_batch(trainer: Trainer) -> Any | None:
    """The batch of the next optimizer step, read ahead without consuming it (``None``: no next step known).

    ``None`` when this step is the last one (``max_steps``, or the last epoch of ``max_epochs``) or the data
    is a stream (an iterable dataset cannot be read twice). A stop requested later (``should_stop``,
    ``max_time``) leaves the read-ahead batch unused. The loader position is not moved, so a checkpoint
    saved now resumes at that batch. The one-step-off rollout uses it to generate the next step's
    responses while this step trains (:mod:`verl_trainer.algorithms.one_step_off`).
    """
    loader = trainer.train_loader
    if not isinstance(loader, ShardedLoader) or 0 < trainer.max_steps <= trainer.global_step + 1:
        return None
    if loader.exhausted() and trainer.max_epochs is not None and loader.epoch + 1 >= trainer.max_epochs:
        return None
    group = loader.peek(trainer.accumulate_grad_batches)
    if not group:
        return None
    return group[0] if len(group) == 1 else concat_batches(group)


def fit_loop(trainer: Trainer) -> None:
    """Run training steps until ``max_steps`` / ``max_epochs`` / ``max_time`` / ``trainer.should_stop``."""
    module, loader = trainer.module, trainer.train_loader
    if isinstance(trainer.val_check_interval, float) and trainer.val_loader is not None:
        trainer.validation_due()  # a fraction of a stream of unknown length fails here, before any step
    started = time.monotonic()
    metric_group = trainer.metric_group
    trainer.logging.setup(trainer.is_global_zero, module.hparams)
    trainer.call_hook("on_fit_start")
    _warn_unknown_hooks(trainer)
    evaluation.sanity_check(trainer)
    trainer.call_hook("on_train_start")
    while not _steps_done(trainer):
        trainer.call_hook("on_train_epoch_start")
        for batch, batch_idx in _step_batches(trainer, loader):
            trainer.call_hook("on_train_batch_start", batch, batch_idx)
            outputs = module.training_step(batch, batch_idx)
            for engine in _trainable(trainer):
                engine.lr_scheduler_step()
            trainer.global_step += 1
            trainer.logging.add(outputs)  # the step's outputs with what was logged during it, reduced
            trainer.logging.reduce(metric_group)  # over micro-batches and ranks before any callback sees them
            trainer.call_hook("on_train_batch_end", outputs, batch, batch_idx)
            trainer.flush_metrics()
            if trainer.validation_due():
                evaluation.validation_loop(trainer)
            _check_time(trainer, started)
            if _steps_done(trainer):
                break
        if loader.batches == 0:
            raise ValueError(
                f"the training data yields no batch on dp rank {trainer.dp_rank} (limit_train_batches="
                f"{trainer.limits['train']!r})"
            )
        finished = loader.exhausted()
        trainer.call_hook("on_train_epoch_end")
        trainer.flush_metrics()
        if finished:
            loader.next_epoch()
    trainer.call_hook("on_train_end")
    trainer.call_hook("on_fit_end")
    trainer.flush_metrics(force=True)


def _warn_unknown_hooks(trainer: Trainer) -> None:
    if not trainer.is_global_zero:
        return
    for cb in trainer.callbacks:
        names = unknown_hooks(cb)
        if names:
            warnings.warn(
                f"{type(cb).__name__} defines {', '.join(names)}, which the Trainer never calls (not a "
                f"callback hook: a typo, or a LightningModule-only hook); callback hooks: "
                f"{', '.join(sorted(HOOK_NAMES))}",
                stacklevel=3,
            )


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
        if not (path / STATE_FILE).is_file():
            raise FileNotFoundError(f"ckpt_path={str(ckpt_path)!r} is not a complete checkpoint directory")
        return path
    found = broadcast_object(str(find_last_checkpoint(trainer.checkpoint_dir) or ""))  # rank 0's choice
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
