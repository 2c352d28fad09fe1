"""The Trainer's logging state: one object that turns typed metric values into logged numbers.

Everything that reaches a logger takes one path: a value declares its reduction
(:class:`~verl_trainer.metrics.Metric`; a plain number is a MEAN over ranks), :meth:`MetricLogging.add`
accumulates it on every rank, :meth:`MetricLogging.reduce` reduces what was accumulated over
micro-batches and ranks (a collective), the reduced values become ``callback_metrics`` and wait for
:meth:`MetricLogging.flush`, which hands them to the loggers on global rank 0 when due. The module's step
outputs (added and reduced by the loops), the balance metrics of ``SequenceBalancing`` and the LR and
throughput monitors all use it. Logging is SPMD: every rank adds the same names in the same order.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from verl_trainer.metrics import Metric, MetricAccumulator
from verl_trainer.training.loggers import build_loggers, plain_hparams

if TYPE_CHECKING:
    from lightning.fabric.loggers import Logger

    from verl_trainer.training.loggers import LoggerSpec

__all__ = ["MetricLogging", "accumulate_outputs"]


def _as_metric(value: Any) -> Metric | None:
    if isinstance(value, Metric):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return Metric.mean(float(value.detach()))
    if isinstance(value, numbers.Real):
        return Metric.mean(float(value))
    return None


def accumulate_outputs(acc: MetricAccumulator, outputs: Mapping[str, Any] | None) -> None:
    """Add one step's (or validation batch's) outputs to ``acc``.

    A :class:`Metric` keeps its declared reduction; a plain number or 0-d tensor is a MEAN over ranks; a
    list of per-micro-batch ``{name: Metric}`` dicts is merged in under their own names; anything else
    (tensors, batches) is not logged.

    Raises:
        TypeError: ``outputs`` is not a mapping.
    """
    if outputs is None or (isinstance(outputs, Mapping) and not outputs):
        return
    if isinstance(outputs, torch.Tensor):  # Lightning's habit: return the loss and let the trainer step
        raise TypeError(
            "training_step/validation_step returned a tensor (Lightning's loss); here the engine runs "
            "backward and the optimizer step inside the step: call out = self.actor.train_batch(batch, "
            "loss_fn, hooks=self.step_hooks) and return a mapping of metrics, e.g. {'train/loss': "
            "out['loss']} (docs/lightning.md, Modules)"
        )
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


class MetricLogging:
    """Accumulated, reduced and logged metric values of a run (owned by the Trainer).

    Args:
        spec: ``Trainer(logger=...)``; loggers are built on global rank 0 by :meth:`setup`.
        root_dir: Where string-named loggers write.
        log_every_n_steps: Log every N steps (and on the last step, or when forced).

    Attributes:
        loggers: The loggers (empty except on global rank 0 once set up).
        callback_metrics: Every reduced value of the run so far, newest last (the same on every rank).
        logged_metrics: The values handed to the loggers last.
    """

    def __init__(self, spec: LoggerSpec, root_dir: str, log_every_n_steps: int) -> None:
        self.spec = spec
        self.root_dir = root_dir
        self.log_every_n_steps = log_every_n_steps
        self.loggers: list[Logger] = []
        self.callback_metrics: dict[str, float] = {}
        self.logged_metrics: dict[str, float] = {}
        self._built = False
        self._acc = MetricAccumulator()
        self._pending: dict[str, float] = {}
        self.run_config: dict[str, Any] | None = None  # the recipes' whole resolved config (plain data)

    def setup(self, is_global_zero: bool, hparams: Any = None) -> None:
        """Build the loggers once (rank 0) and log ``hparams`` (plain data) to them.

        With :attr:`run_config` set (the recipes set their whole resolved config: trainer, model, data,
        ...), that is logged, its ``algorithm`` section replaced by the module's own ``hparams``.
        """
        if not self._built:
            self._built = True
            self.loggers = build_loggers(self.spec, self.root_dir) if is_global_zero else []
        flat = plain_hparams(hparams or {})
        if self.run_config is not None:
            flat = {**plain_hparams(self.run_config), **({"algorithm": flat} if flat else {})}
        if flat:
            for lg in self.loggers:
                lg.log_hyperparams(flat)

    # ------------------------------------------------------------------------------ the one path
    def add(self, metrics: Mapping[str, Any] | None) -> None:
        """Accumulate typed values (see :func:`accumulate_outputs`); nothing is reduced yet."""
        accumulate_outputs(self._acc, metrics)

    def reduce(self, process_group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """Reduce what was added since the last reduce over micro-batches and ranks (a collective).

        Returns:
            The reduced values (the same on every rank); they also join ``callback_metrics`` and wait
            for :meth:`flush`.
        """
        acc, self._acc = self._acc, MetricAccumulator()
        values = acc.compute(process_group=process_group)
        self.callback_metrics.update(values)
        self._pending.update(values)
        return values

    def pending(self) -> dict[str, float]:
        """Reduced values waiting for the next :meth:`flush`."""
        return dict(self._pending)

    def flush(self, step: int, force: bool = False, last_step: bool = False) -> None:
        """Log the pending values at ``step`` on rank 0 when due; values of a step not due are dropped.

        Values added but not yet reduced are reduced first (a collective, when this rank added any:
        logging is SPMD, so every rank did).

        Args:
            step: The trainer step the values belong to.
            force: Log whatever the interval says.
            last_step: The run's last step (always logged, as in Lightning).
        """
        if len(self._acc):
            self.reduce()
        if not self._pending:
            return
        if force or last_step or step % self.log_every_n_steps == 0:
            self.logged_metrics = dict(self._pending)
            for lg in self.loggers:
                lg.log_metrics(self.logged_metrics, step=step)
        self._pending.clear()

    def discard(self, callback_metrics: Mapping[str, float]) -> None:
        """Drop what waits to be logged (reducing first) and restore ``callback_metrics`` (sanity check)."""
        if len(self._acc):
            self.reduce()
        self._pending.clear()
        self.callback_metrics = dict(callback_metrics)

    def finalize(self, status: str) -> None:
        """Save and close every logger (``status``: ``"success"`` or ``"failed"``)."""
        for lg in self.loggers:
            lg.save()
            lg.finalize(status)

    def save(self) -> None:
        """Write what the loggers buffer (before a checkpoint, so it never precedes its own logs)."""
        for lg in self.loggers:
            lg.save()
