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

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from verl_trainer.data.sharded_loader import ShardedLoader
from verl_trainer.module import TrainingModule
from verl_trainer.training.logging import MetricLogging
from verl_trainer.training.progress import Progress

__all__ = ["EVAL_STAGES", "EvaluationLoop"]

EVAL_STAGES = ("test", "predict")
"""Stages whose data is ``eval_loader`` (``test_dataloader()`` / ``predict_dataloader()``)."""


def _batches(loader: ShardedLoader, limit: int | None = None) -> Iterator[tuple[int, Any]]:
    loader.epoch, loader.batches = 0, 0
    for batch_idx, batch in enumerate(loader.epoch_batches()):
        if limit is not None and batch_idx >= limit:
            return
        yield batch_idx, batch


class EvaluationLoop:
    """Validation, sanity check, test and predict over one stage's data.

    Args:
        module: The module whose ``validation_step`` / ``test_step`` / ``predict_step`` run.
        progress: The run's progress (its evaluation flags are set here; ``global_step`` is read).
        call_hook: The callbacks' dispatch, ``call_hook(name, *args)``.
        logging: The run's metric state.
        flush: Logs the pending values (``flush(force=True)``: now).
        metric_group: The group outputs are reduced over (``None``: the world).
        val_loader: The validation data (``None``: none).
        eval_loader: The test / predict data (``None``: none).
        num_sanity_val_steps: Validation batches of the sanity check at the start of fit (-1: all).
    """

    def __init__(self, module: TrainingModule, progress: Progress, call_hook: Callable[..., object],
                 logging: MetricLogging, flush: Callable[..., None], metric_group: dist.ProcessGroup | None,
                 val_loader: ShardedLoader | None = None, eval_loader: ShardedLoader | None = None,
                 num_sanity_val_steps: int = 0) -> None:
        self.module, self.progress, self.call_hook, self.logging = module, progress, call_hook, logging
        self.flush, self.metric_group = flush, metric_group
        self.val_loader, self.eval_loader = val_loader, eval_loader
        self.num_sanity_val_steps = num_sanity_val_steps

    def _evaluate(self, prefix: str, loader: ShardedLoader, step_name: str,
                  limit: int | None = None) -> dict[str, float]:
        step = getattr(self.module, step_name)
        self.flush()
        self.call_hook(f"on_{prefix}_start")
        self.call_hook(f"on_{prefix}_epoch_start")
        self.progress.evaluating = True  # self.log's on_step / on_epoch: evaluation values are per run
        try:
            with torch.no_grad():
                for batch_idx, batch in _batches(loader, limit):
                    self.call_hook(f"on_{prefix}_batch_start", batch, batch_idx)
                    outputs = step(batch, batch_idx)
                    self.logging.add(outputs)  # reduced with every batch's, once, below
                    self.call_hook(f"on_{prefix}_batch_end", outputs, batch, batch_idx)
        finally:
            self.progress.evaluating = False
        self.logging.reduce(self.metric_group)  # before on_*_epoch_end: callbacks see the reduced values
        values = self.logging.pending()  # kept: a checkpoint saved in on_*_end flushes (logs) them
        self.call_hook(f"on_{prefix}_epoch_end")
        self.call_hook(f"on_{prefix}_end")
        return {**values, **self.logging.pending()}

    def validate(self, limit: int | None = None) -> dict[str, float]:
        """Run the validation batches once (at most ``limit``); returns the values logged for it.

        They are also kept, with the step, as ``progress.last_validation``.

        Raises:
            ValueError: There is no validation data.
        """
        if self.val_loader is None:
            raise ValueError("validate needs validation data: a datamodule with val_dataloader()")
        values = self._evaluate("validation", self.val_loader, "validation_step", limit)
        self.flush(force=True)
        self.progress.last_validation = (self.progress.global_step, dict(values))
        return values

    def sanity_check(self) -> None:
        """``num_sanity_val_steps`` validation batches before training; their metrics are discarded."""
        count = self.num_sanity_val_steps
        if not count or self.val_loader is None or self.progress.global_step > 0:
            return
        before = dict(self.logging.callback_metrics)
        self.progress.sanity_checking = True
        try:
            self.call_hook("on_sanity_check_start")
            self._evaluate("validation", self.val_loader, "validation_step", None if count < 0 else count)
            self.logging.discard(before)
            self.call_hook("on_sanity_check_end")
        finally:
            self.progress.sanity_checking = False

    def run_stage(self, stage: str) -> Any:
        """``test`` → ``[metrics]``; ``predict`` → this rank's list of ``predict_step`` outputs.

        Raises:
            ValueError: The stage has no data.
        """
        loader = self.eval_loader
        if loader is None:
            raise ValueError(
                f"{stage} needs data: a datamodule with {stage}_dataloader(), a DataLoader passed as "
                f"datamodule, or module.{stage}_dataloader()"
            )
        if stage == "test":
            values = self._evaluate("test", loader, "test_step")
            self.flush(force=True)
            return [values]
        predictions = []
        self.call_hook("on_predict_start")
        self.call_hook("on_predict_epoch_start")
        with torch.no_grad():
            for batch_idx, batch in _batches(loader):
                self.call_hook("on_predict_batch_start", batch, batch_idx)
                out = self.module.predict_step(batch, batch_idx)
                self.call_hook("on_predict_batch_end", out, batch, batch_idx)
                predictions.append(out)
        self.call_hook("on_predict_epoch_end")
        self.call_hook("on_predict_end")
        return predictions
