"""MetricReduction: over which group the loops reduce a step's outputs (one value per metric, every rank).

On by default and always the first callback. The loops do the work (``training/fit_loop.py``,
``training/evaluation.py``): right after ``training_step`` (before any ``on_train_batch_end``) they put
what it returned (see ``verl_trainer.module``) on the Trainer's one metric path
(:class:`~verl_trainer.metrics.Metric` values keep their declared reduction, lists of per-micro-batch
``{name: Metric}`` dicts are merged in, plain numbers are a MEAN over ranks) together with what callbacks
logged during the step (balance metrics, learning rates), and reduce it all over micro-batches and ranks
(a collective on every rank), so every callback and the loggers see reduced values. Validation and test
outputs are added batch by batch and reduced once, before ``on_validation_epoch_end`` /
``on_test_epoch_end``. This callback holds the one setting of that reduction: its process group.
"""

from __future__ import annotations

from typing import Literal

from verl_trainer.callbacks.base import Callback


class MetricReduction(Callback):
    """The group step and evaluation outputs are reduced over (the loops reduce; see the module docstring).

    Args:
        group: ``"world"`` (default) or ``"dp"`` (the run's data-parallel group); both give the same
            values (``verl_trainer.metrics``), the DP group moves less data when SP > 1.
    """

    def __init__(self, group: Literal["world", "dp"] = "world") -> None:
        if group not in ("world", "dp"):
            raise ValueError(f"MetricReduction(group={group!r}); choose 'world' or 'dp'")
        self.group = group
