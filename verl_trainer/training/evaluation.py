"""Validation, sanity-check, test and predict loops of :class:`verl_trainer.Trainer`.

Hook order of one validation run (test: the same with ``test`` in the names)::

    on_validation_start → on_validation_epoch_start → (on_validation_batch_start → validation_step →
    on_validation_batch_end)* → on_validation_epoch_end → on_validation_end

The loop reduces the outputs of all batches over batches and ranks (over ``MetricReduction``'s group)
before ``on_validation_epoch_end``, so callbacks (``EarlyStopping``) see ``callback_metrics``, and a
``ModelCheckpoint`` saving in ``on_validation_end`` sees them too. The sanity check (``num_sanity_val_steps``
batches at the start of fit) runs the same loop between ``on_sanity_check_start`` / ``_end`` and its
values are discarded. Predict: ``on_predict_start → on_predict_epoch_start → (on_predict_batch_start →
predict_step → on_predict_batch_end)* → on_predict_epoch_end → on_predict_end``; it returns this rank's
``predict_step`` outputs in batch order (the rows of this rank's shard; the sampler's repeats of the last
round are not removed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from verl_trainer.trainer import Trainer
    from verl_trainer.training.data import ShardedLoader

__all__ = ["EVAL_STAGES", "run_eval_stage", "sanity_check", "validation_loop"]

EVAL_STAGES = ("test", "predict")
"""Stages whose data is ``eval_loader`` (``test_dataloader()`` / ``predict_dataloader()``)."""


def _batches(loader: ShardedLoader, limit: int | None = None) -> Any:
    loader.epoch, loader.batches = 0, 0
    for batch_idx, batch in enumerate(loader.epoch_batches()):
        if limit is not None and batch_idx >= limit:
            return
        yield batch_idx, batch


def _evaluate(trainer: Trainer, prefix: str, loader: ShardedLoader, step_name: str,
              limit: int | None = None) -> dict[str, float]:
    module = trainer.module
    step = getattr(module, step_name)
    trainer.flush_metrics()
    trainer.call_hook(f"on_{prefix}_start")
    trainer.call_hook(f"on_{prefix}_epoch_start")
    trainer.evaluating = True  # self.log's on_step / on_epoch: evaluation values are per run
    try:
        with torch.no_grad():
            for batch_idx, batch in _batches(loader, limit):
                trainer.call_hook(f"on_{prefix}_batch_start", batch, batch_idx)
                outputs = step(batch, batch_idx)
                trainer.logging.add(outputs)  # reduced with every batch's, once, below
                trainer.call_hook(f"on_{prefix}_batch_end", outputs, batch, batch_idx)
    finally:
        trainer.evaluating = False
    trainer.logging.reduce(trainer.metric_group)  # before on_*_epoch_end: callbacks see the reduced values
    values = trainer.logging.pending()  # kept: a checkpoint saved in on_*_end flushes (logs) them
    trainer.call_hook(f"on_{prefix}_epoch_end")
    trainer.call_hook(f"on_{prefix}_end")
    return {**values, **trainer.logging.pending()}


def validation_loop(trainer: Trainer, limit: int | None = None) -> dict[str, float]:
    """Run the validation batches once (at most ``limit``); returns the values logged for it.

    They are also kept, with the step, as ``trainer.last_validation``.
    """
    values = _evaluate(trainer, "validation", trainer.val_loader, "validation_step", limit)
    trainer.flush_metrics(force=True)
    trainer.last_validation = (trainer.global_step, dict(values))
    return values


def sanity_check(trainer: Trainer) -> None:
    """``num_sanity_val_steps`` validation batches before training; their metrics are discarded."""
    count = trainer.num_sanity_val_steps
    if not count or trainer.val_loader is None or trainer.global_step > 0:
        return
    before = dict(trainer.callback_metrics)
    trainer.sanity_checking = True
    try:
        trainer.call_hook("on_sanity_check_start")
        _evaluate(trainer, "validation", trainer.val_loader, "validation_step", None if count < 0 else count)
        trainer.logging.discard(before)
        trainer.call_hook("on_sanity_check_end")
    finally:
        trainer.sanity_checking = False


def run_eval_stage(trainer: Trainer, stage: str) -> Any:
    """``test`` → ``[metrics]``; ``predict`` → this rank's list of ``predict_step`` outputs.

    Raises:
        ValueError: The stage has no data.
    """
    loader = trainer.eval_loader
    if loader is None:
        raise ValueError(
            f"{stage} needs data: a datamodule with {stage}_dataloader(), a DataLoader passed as datamodule, "
            f"or module.{stage}_dataloader()"
        )
    if stage == "test":
        values = _evaluate(trainer, "test", loader, "test_step")
        trainer.flush_metrics(force=True)
        return [values]
    module, predictions = trainer.module, []
    trainer.call_hook("on_predict_start")
    trainer.call_hook("on_predict_epoch_start")
    with torch.no_grad():
        for batch_idx, batch in _batches(loader):
            trainer.call_hook("on_predict_batch_start", batch, batch_idx)
            out = module.predict_step(batch, batch_idx)
            trainer.call_hook("on_predict_batch_end", out, batch, batch_idx)
            predictions.append(out)
    trainer.call_hook("on_predict_epoch_end")
    trainer.call_hook("on_predict_end")
    return predictions
