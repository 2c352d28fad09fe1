"""LearningRateMonitor: logs the learning rate each step uses, per engine (``lr/<engine>``)."""

from __future__ import annotations

from typing import Any

from verl_trainer.callbacks.base import Callback
from verl_trainer.metrics import Metric


class LearningRateMonitor(Callback):
    """Log ``lr/<engine>`` (``lr/<engine>/pg<i>`` for several parameter groups) for trainable engines.

    Logged in ``on_train_batch_start``, i.e. the rate the step is about to use (as Lightning does).

    Args:
        prefix: Name prefix.
    """

    def __init__(self, prefix: str = "lr") -> None:
        self.prefix = prefix

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        """Record the current learning rates."""
        values: dict[str, float] = {}
        for name, engine in module.engines.items():
            optimizer = getattr(engine, "optimizer", None)
            if optimizer is None:
                continue
            groups = optimizer.param_groups
            if len(groups) == 1:
                values[f"{self.prefix}/{name}"] = float(groups[0]["lr"])
            else:
                values.update({f"{self.prefix}/{name}/pg{i}": float(g["lr"]) for i, g in enumerate(groups)})
        trainer.log_metrics({k: Metric.mean(v) for k, v in values.items()})  # the same on every rank
