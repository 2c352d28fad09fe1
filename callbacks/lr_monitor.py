"""LearningRateMonitor: logs the learning rate each step uses, per engine (``lr/<engine>``)."""

from __future__ import annotations

from typing import Any

from verl_trainer.callbacks.base import Callback
from verl_trainer.callbacks.contract import CallbackModule, CallbackTrainer
from verl_trainer.metrics import Metric

INTERVALS = (None, "step", "epoch")


class LearningRateMonitor(Callback):
    """Log ``lr/<engine>`` (``lr/<engine>/pg<i>`` for several parameter groups) for trainable engines.

    Logged in ``on_train_batch_start``, i.e. the rate the step is about to use (as Lightning does), or in
    ``on_train_epoch_start`` with ``logging_interval="epoch"``.

    Args:
        prefix: Name prefix.
        logging_interval: Lightning's: ``"step"``, ``"epoch"``, or ``None`` (the schedulers' interval: they
            step once per trainer step here, so ``"step"``).
        log_momentum: Lightning's: also log ``<name>/momentum`` (Adam's ``betas[0]``, SGD's ``momentum``).
        log_weight_decay: Lightning's: also log ``<name>/weight_decay``.

    Raises:
        ValueError: An unknown ``logging_interval``.
    """

    def __init__(self, prefix: str = "lr", logging_interval: str | None = None, log_momentum: bool = False,
                 log_weight_decay: bool = False) -> None:
        if logging_interval not in INTERVALS:
            raise ValueError(f"LearningRateMonitor(logging_interval={logging_interval!r}); choose one of "
                             f"{INTERVALS} (None: every step, the schedulers' interval here)")
        self.prefix = prefix
        self.logging_interval = logging_interval
        self.log_momentum, self.log_weight_decay = log_momentum, log_weight_decay

    def _record(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        values: dict[str, float] = {}
        for name, engine in module.engines.items():
            optimizer = getattr(engine, "optimizer", None)
            if optimizer is None:
                continue
            groups = optimizer.param_groups
            for i, group in enumerate(groups):
                key = f"{self.prefix}/{name}" + (f"/pg{i}" if len(groups) > 1 else "")
                values[key] = float(group["lr"])
                if self.log_momentum:
                    momentum = group["betas"][0] if "betas" in group else group.get("momentum", 0.0)
                    values[f"{key}/momentum"] = float(momentum)
                if self.log_weight_decay:
                    values[f"{key}/weight_decay"] = float(group.get("weight_decay", 0.0))
        trainer.log_metrics({k: Metric.mean(v) for k, v in values.items()})  # the same on every rank

    def on_train_batch_start(
        self, trainer: CallbackTrainer, module: CallbackModule, batch: Any, batch_idx: int
    ) -> None:
        """Record the current learning rates (per step)."""
        if self.logging_interval != "epoch":
            self._record(trainer, module)

    def on_train_epoch_start(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Record the learning rates at the start of an epoch (``logging_interval="epoch"``)."""
        if self.logging_interval == "epoch":
            self._record(trainer, module)
