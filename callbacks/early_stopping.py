"""EarlyStopping: stop fit when a monitored metric stops improving (Lightning's arguments and meaning).

The monitored value is read from ``trainer.callback_metrics``, which holds values already reduced over
micro-batches and ranks — the same on every rank — so every rank takes the same decision without a
collective. Checked at the end of each validation run (after the loop reduced it), or at the end
of each training epoch with ``check_on_train_epoch_end=True`` (the default when the run has no validation
data). A stop request is honoured after ``Trainer(min_steps=, min_epochs=)``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from verl_trainer.callbacks.base import Callback
from verl_trainer.callbacks.contract import CallbackModule, CallbackTrainer

__all__ = ["EarlyStopping"]


class EarlyStopping(Callback):
    """Stop training when ``monitor`` has not improved for ``patience`` checks.

    Args:
        monitor: Metric name in ``trainer.callback_metrics`` (e.g. ``"val/loss"``).
        min_delta: Smallest change that counts as an improvement.
        patience: Checks without improvement before stopping.
        verbose: Print the reason on rank 0.
        mode: ``"min"`` (lower is better) or ``"max"``.
        strict: A missing ``monitor`` is an error (else a skipped check).
        check_finite: Stop when the value is NaN or infinite.
        stopping_threshold: Stop as soon as the value is better than this.
        divergence_threshold: Stop as soon as the value is worse than this.
        check_on_train_epoch_end: Check at the end of training epochs instead of after validation
            (``None``: only when the run has no validation data).

    Raises:
        ValueError: An unknown ``mode``, a negative ``patience``.
    """

    def __init__(self, monitor: str, min_delta: float = 0.0, patience: int = 3, verbose: bool = False,
                 mode: Literal["min", "max"] = "min", strict: bool = True, check_finite: bool = True,
                 stopping_threshold: float | None = None, divergence_threshold: float | None = None,
                 check_on_train_epoch_end: bool | None = None) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping(mode={mode!r}); choose 'min' or 'max'")
        if not isinstance(patience, int) or patience < 0:
            raise ValueError(f"EarlyStopping(patience={patience!r}); use an int >= 0")
        self.monitor, self.mode, self.patience, self.verbose = monitor, mode, patience, verbose
        self.min_delta = abs(float(min_delta)) * (1 if mode == "max" else -1)
        self.strict, self.check_finite = strict, check_finite
        self.stopping_threshold, self.divergence_threshold = stopping_threshold, divergence_threshold
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self.wait_count = 0
        self.best_score = math.inf if mode == "min" else -math.inf
        self.stopped_step = 0
        self.stop_reason: str | None = None

    @property
    def state_key(self) -> str:
        """Distinct per monitored metric and mode (several EarlyStopping callbacks may coexist)."""
        return f"EarlyStopping{{monitor={self.monitor!r}, mode={self.mode!r}}}"

    def _better(self, a: float, b: float) -> bool:
        return a < b if self.mode == "min" else a > b

    def _on_train_epoch(self, trainer: CallbackTrainer) -> bool:
        if self.check_on_train_epoch_end is None:
            return trainer.val_loader is None
        return self.check_on_train_epoch_end

    def on_validation_end(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Check after a validation run during fit (not the sanity check)."""
        if trainer.state == "fit" and not trainer.sanity_checking and not self._on_train_epoch(trainer):
            self._check(trainer)

    def on_train_epoch_end(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Check at the end of a training epoch (``check_on_train_epoch_end``)."""
        if self._on_train_epoch(trainer):
            self._check(trainer)

    def _check(self, trainer: CallbackTrainer) -> None:
        metrics = trainer.callback_metrics
        if self.monitor not in metrics:
            if self.strict:
                raise RuntimeError(
                    f"EarlyStopping(monitor={self.monitor!r}) found no such metric; available: "
                    f"{', '.join(sorted(metrics)) or 'none'} (or pass strict=False to skip the check)"
                )
            return
        value = float(metrics[self.monitor])
        reason = self._evaluate(value)
        if reason is not None:
            trainer.should_stop = True
            self.stopped_step, self.stop_reason = trainer.global_step, reason
            if self.verbose and trainer.is_global_zero:
                print(f"EarlyStopping at step {trainer.global_step}: {reason}", flush=True)

    def _evaluate(self, value: float) -> str | None:
        """Update the state with ``value``; the reason to stop, or ``None``."""
        if self.check_finite and not math.isfinite(value):
            return f"{self.monitor} = {value} is not finite"
        if self.stopping_threshold is not None and self._better(value, self.stopping_threshold):
            return f"{self.monitor} = {value} reached stopping_threshold={self.stopping_threshold}"
        if self.divergence_threshold is not None and self._better(self.divergence_threshold, value):
            return f"{self.monitor} = {value} passed divergence_threshold={self.divergence_threshold}"
        if self._better(value - self.min_delta, self.best_score):
            self.best_score, self.wait_count = value, 0
            return None
        self.wait_count += 1
        if self.wait_count >= self.patience:
            return (f"{self.monitor} did not improve for {self.wait_count} checks (best {self.best_score}, "
                    f"min_delta={abs(self.min_delta)})")
        return None

    def state_dict(self) -> dict[str, Any]:
        """Best value, checks without improvement, patience (plain data)."""
        return {"wait_count": self.wait_count, "best_score": self.best_score, "patience": self.patience,
                "stopped_step": self.stopped_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the current ``patience`` applies)."""
        self.wait_count = int(state_dict["wait_count"])
        self.best_score = float(state_dict["best_score"])
        self.stopped_step = int(state_dict.get("stopped_step", 0))
