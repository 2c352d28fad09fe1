"""MetricReduction: the module's step outputs → one value per metric, the same on every rank.

On by default and always the first callback, so every callback after it (progress bar, checkpoint)
and the loggers see reduced values. It puts what ``training_step`` returned (see
``verl_trainer.module``) on the Trainer's one metric path (:meth:`Trainer.log_metrics
<verl_trainer.Trainer.log_metrics>`: :class:`~verl_trainer.metrics.Metric` values keep their declared
reduction, lists of per-micro-batch ``{name: Metric}`` dicts are merged in, plain numbers are a MEAN over
ranks) together with what other callbacks logged during the step (balance metrics, learning rates),
and reduces it all over micro-batches and ranks (:meth:`Trainer.reduce_metrics
<verl_trainer.Trainer.reduce_metrics>`, a collective on every rank). Validation outputs of all batches are
added as they come and reduced once, in ``on_validation_epoch_end`` (test: the same).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from verl_trainer.callbacks.base import Callback

if TYPE_CHECKING:
    import torch.distributed as dist

    from verl_trainer.module import StepOutput, TrainingModule
    from verl_trainer.trainer import Trainer


class MetricReduction(Callback):
    """Reduce step and validation outputs over micro-batches and ranks, then hand them to logging.

    Args:
        group: ``"world"`` (default) or ``"dp"`` (the run's data-parallel group); both give the same
            values (``verl_trainer.metrics``), the DP group moves less data when SP > 1.
    """

    def __init__(self, group: Literal["world", "dp"] = "world") -> None:
        if group not in ("world", "dp"):
            raise ValueError(f"MetricReduction(group={group!r}); choose 'world' or 'dp'")
        self.group = group

    def _process_group(self, trainer: Trainer) -> dist.ProcessGroup | None:
        return trainer.dp_group if self.group == "dp" else None

    def on_train_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: StepOutput | None,
                           batch: Any, batch_idx: int) -> None:
        """Add the step's outputs and reduce everything the step logged."""
        trainer.log_metrics(outputs)
        trainer.reduce_metrics(self._process_group(trainer))

    def on_validation_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: StepOutput | None,
                                batch: Any, batch_idx: int) -> None:
        """Add one validation batch's outputs."""
        trainer.log_metrics(outputs)

    def on_validation_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Reduce all validation outputs once (before ``on_validation_end``: checkpoints see them)."""
        trainer.reduce_metrics(self._process_group(trainer))

    def on_test_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: StepOutput | None,
                          batch: Any, batch_idx: int) -> None:
        """Add one test batch's outputs."""
        trainer.log_metrics(outputs)

    def on_test_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Reduce all test outputs once."""
        trainer.reduce_metrics(self._process_group(trainer))
