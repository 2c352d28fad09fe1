"""Timer: stop fit after a wall-clock duration and report the time of each stage (Lightning's arguments).

``Trainer(max_time=...)`` is the same limit without a callback. Rank 0's clock decides, broadcast to every
rank (one small collective per check), so all ranks stop at the same step. The elapsed training time is
saved in checkpoints, so a resumed run counts it.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Literal

from verl_trainer.callbacks.base import Callback
from verl_trainer.callbacks.contract import CallbackModule, CallbackTrainer
from verl_trainer.utils.distributed import broadcast_object
from verl_trainer.utils.durations import parse_max_time

__all__ = ["Timer"]

_STAGES = ("train", "validate", "test", "predict")


class Timer(Callback):
    """Track the time of each stage; stop training after ``duration``.

    Args:
        duration: ``"DD:HH:MM:SS"``, a ``timedelta`` or a dict of ``timedelta`` arguments (``None``: only
            measure).
        interval: Check after every ``"step"`` or every ``"epoch"``.
        verbose: Print when the time is up (rank 0).

    Raises:
        ValueError: A bad ``duration`` or ``interval``.
    """

    def __init__(self, duration: str | timedelta | dict[str, int] | None = None,
                 interval: Literal["step", "epoch"] = "step", verbose: bool = True) -> None:
        if interval not in ("step", "epoch"):
            raise ValueError(f"Timer(interval={interval!r}); choose 'step' or 'epoch'")
        self.duration = parse_max_time(duration)
        self.interval, self.verbose = interval, verbose
        self._start: dict[str, float | None] = dict.fromkeys(_STAGES)
        self._end: dict[str, float | None] = dict.fromkeys(_STAGES)
        self._offset = 0.0  # training seconds of the run before a resume

    def start_time(self, stage: str = "train") -> float | None:
        """``time.monotonic()`` when ``stage`` started (``None``: not yet)."""
        return self._start[stage]

    def end_time(self, stage: str = "train") -> float | None:
        """``time.monotonic()`` when ``stage`` ended (``None``: not yet)."""
        return self._end[stage]

    def time_elapsed(self, stage: str = "train") -> float:
        """Seconds spent in ``stage`` (training: including the time before a resume)."""
        start, end = self._start[stage], self._end[stage]
        offset = self._offset if stage == "train" else 0.0
        if start is None:
            return offset
        return offset + ((end if end is not None else time.monotonic()) - start)

    def time_remaining(self, stage: str = "train") -> float | None:
        """Seconds left of ``duration`` (``None`` without one)."""
        return None if self.duration is None else self.duration.total_seconds() - self.time_elapsed(stage)

    def _mark(self, stage: str, which: dict[str, float | None]) -> None:
        which[stage] = time.monotonic()

    def on_train_start(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Record when train starts."""
        self._mark("train", self._start)

    def on_train_end(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Record when train ends."""
        self._mark("train", self._end)

    def on_validation_start(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Record when validation starts."""
        self._mark("validate", self._start)

    def on_validation_end(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Record when validation ends."""
        self._mark("validate", self._end)

    def on_test_start(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Record when test starts."""
        self._mark("test", self._start)

    def on_test_end(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Record when test ends."""
        self._mark("test", self._end)

    def on_predict_start(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Record when predict starts."""
        self._mark("predict", self._start)

    def on_predict_end(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Record when predict ends."""
        self._mark("predict", self._end)

    def on_train_batch_end(
        self, trainer: CallbackTrainer, module: CallbackModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Check after each step (``interval="step"``)."""
        if self.interval == "step":
            self._check(trainer)

    def on_train_epoch_end(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Check after each epoch (``interval="epoch"``)."""
        if self.interval == "epoch":
            self._check(trainer)

    def _check(self, trainer: CallbackTrainer) -> None:
        if self.duration is None:
            return
        up = bool(broadcast_object(self.time_elapsed("train") >= self.duration.total_seconds()))
        if up:
            trainer.should_stop = True
            if self.verbose and trainer.is_global_zero:
                print(f"Timer: {self.duration} elapsed; stopping at step {trainer.global_step}", flush=True)

    def state_dict(self) -> dict[str, Any]:
        """The training seconds so far (plain data)."""
        return {"time_elapsed_train": self.time_elapsed("train")}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Count the checkpoint's training time in :meth:`time_elapsed`."""
        self._offset = float(state_dict.get("time_elapsed_train", 0.0))
