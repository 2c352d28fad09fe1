"""MetricReduction: the module's step outputs → one value per metric, the same on every rank.

On by default and always the first callback, so every callback after it (progress bar, checkpoint)
and the loggers see reduced values. Per step it reads what ``training_step`` returned (see
``verl_trainer.module``): :class:`~verl_trainer.metrics.Metric` values keep their declared reduction,
lists of per-micro-batch ``{name: Metric}`` dicts are merged in, plain numbers are a MEAN over ranks;
:class:`~verl_trainer.metrics.MetricAccumulator` reduces them over micro-batches and ranks (a collective
on every rank) and the result goes to :meth:`Trainer.log_metrics`. Validation outputs of all batches are
accumulated together and reduced once, in ``on_validation_end``.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any, Literal

import torch

from verl_trainer.callbacks.base import Callback
from verl_trainer.metrics import Metric, MetricAccumulator


def _as_metric(value: Any) -> Metric | None:
    if isinstance(value, Metric):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return Metric.mean(float(value.detach()))
    if isinstance(value, numbers.Real):
        return Metric.mean(float(value))
    return None


def accumulate(acc: MetricAccumulator, outputs: Mapping[str, Any] | None) -> None:
    """Add one step's (or validation batch's) outputs to ``acc`` (see the module docstring)."""
    if not outputs:
        return
    if not isinstance(outputs, Mapping):
        raise TypeError(
            f"training_step/validation_step must return a mapping or None, got {type(outputs).__name__}"
        )
    for name, value in outputs.items():
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, Mapping) for v in value):
            for micro_batch in value:
                converted = ((k, _as_metric(v)) for k, v in micro_batch.items())
                acc.update({k: m for k, m in converted if m is not None})
            continue
        metric = _as_metric(value)
        if metric is not None:
            acc.update({name: metric})


class MetricReduction(Callback):
    """Reduce step and validation outputs over micro-batches and ranks, then log them.

    Args:
        group: ``"world"`` (default) or ``"dp"`` (the actor's data-parallel group); both give the same
            values (``verl_trainer.metrics``), the DP group moves less data when SP > 1.
    """

    def __init__(self, group: Literal["world", "dp"] = "world") -> None:
        if group not in ("world", "dp"):
            raise ValueError(f"MetricReduction(group={group!r}); choose 'world' or 'dp'")
        self.group = group
        self._val: MetricAccumulator | None = None

    def _process_group(self, trainer: Any) -> Any:
        return trainer.dp_group if self.group == "dp" else None

    def reduce(self, trainer: Any, outputs: Mapping[str, Any] | None) -> dict[str, float]:
        """Reduced values of one step's outputs (a collective on every rank)."""
        acc = MetricAccumulator()
        accumulate(acc, outputs)
        return acc.compute(process_group=self._process_group(trainer))

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Reduce the step's outputs and hand them to the trainer's logging."""
        trainer.log_metrics(self.reduce(trainer, outputs))

    def on_validation_start(self, trainer: Any, module: Any) -> None:
        """Start accumulating validation outputs."""
        self._val = MetricAccumulator()

    def on_validation_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Add one validation batch's outputs."""
        if self._val is None:
            self._val = MetricAccumulator()
        accumulate(self._val, outputs)

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        """Reduce all validation outputs once and log them."""
        acc, self._val = self._val or MetricAccumulator(), None
        trainer.log_metrics(acc.compute(process_group=self._process_group(trainer)))
