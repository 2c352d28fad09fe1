"""ProgressBar: a rich progress bar on global rank 0 (step, reward, loss, tokens/s, ETA).

In a terminal it is a live ``rich`` bar. When the output is not a terminal (a log file, a pipe, a batch
job) there is no bar: one plain line every ``refresh_rate`` steps and a last line at the end of training,
each whole on one line whatever its length (never wrapped or cut at the console's width).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from verl_trainer.callbacks.base import Callback
from verl_trainer.callbacks.contract import CallbackModule, CallbackTrainer

DEFAULT_METRICS = ("reward", "loss", "tokens_per_sec")


def _pick(metrics: dict[str, float], key: str) -> tuple[str, float] | None:
    """The metric named ``key``, ending in ``/key``, or containing ``key`` (first by name), if any."""
    for test in (lambda n: n == key, lambda n: n.endswith("/" + key), lambda n: key in n):
        names = sorted(n for n in metrics if test(n))
        if names:
            return names[0], metrics[names[0]]
    return None


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _fmt_eta(seconds: float) -> str:
    seconds = int(max(0.0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressBar(Callback):
    """Shows the training progress on global rank 0.

    Args:
        metrics: Keys to show, matched against the logged names (exactly, as the last ``/`` part, or as a
            substring): by default the reward, the loss and tokens/s (``ThroughputMonitor``).
        refresh_rate: Update every N steps.
        console: A rich ``Console`` (default: stdout).
    """

    def __init__(
        self, metrics: Sequence[str] = DEFAULT_METRICS, refresh_rate: int = 1, console: Console | None = None
    ) -> None:
        if refresh_rate < 1:
            raise ValueError(f"ProgressBar(refresh_rate={refresh_rate}) must be >= 1")
        self.metrics = tuple(metrics)
        self.refresh_rate = refresh_rate
        self.console = console
        self._progress: Progress | None = None
        self._task: Any = None
        self._start: tuple[float, int] | None = None

    def _summary(self, trainer: CallbackTrainer) -> str:
        parts = []
        for key in self.metrics:
            found = _pick(trainer.callback_metrics, key)
            if found is not None:
                parts.append(f"{key}={_fmt(found[1])}")
        return " ".join(parts)

    def on_train_start(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Create the bar (rank 0), starting at the resumed step."""
        if not trainer.is_global_zero:
            return
        console = self.console or Console()
        total = trainer.max_steps if trainer.max_steps > 0 else None
        self._progress = Progress(
            TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[metrics]}"),
            TextColumn("eta"), TimeRemainingColumn(), console=console,
        )
        self._task = self._progress.add_task("train", total=total, completed=trainer.global_step, metrics="")
        self._start = (time.monotonic(), trainer.global_step)
        if console.is_terminal:  # a live display; elsewhere plain lines only
            self._progress.start()

    def _line(self, trainer: CallbackTrainer, summary: str) -> str:
        total = trainer.max_steps if trainer.max_steps > 0 else None
        line = f"step {trainer.global_step}" + (f"/{total}" if total else "")
        line += f" {summary}" if summary else ""
        if total and self._start is not None and trainer.global_step > self._start[1]:
            elapsed = time.monotonic() - self._start[0]
            rate = elapsed / (trainer.global_step - self._start[1])
            line += f" eta {_fmt_eta(rate * (total - trainer.global_step))}"
        return line

    def on_train_batch_end(
        self, trainer: CallbackTrainer, module: CallbackModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Advance the bar and show the step's metrics."""
        progress = self._progress
        if progress is None or trainer.global_step % self.refresh_rate:
            return
        summary = self._summary(trainer)
        progress.update(self._task, completed=trainer.global_step, metrics=summary)
        if not progress.console.is_terminal:
            progress.console.print(self._line(trainer, summary), highlight=False, soft_wrap=True)

    def _stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def on_train_end(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Close the bar; without a terminal, print the last line (the final step and its time)."""
        progress = self._progress
        if progress is not None and not progress.console.is_terminal and self._start is not None:
            line = f"done: step {trainer.global_step}"
            summary = self._summary(trainer)
            line += f" {summary}" if summary else ""
            line += f" in {_fmt_eta(time.monotonic() - self._start[0])}"
            progress.console.print(line, highlight=False, soft_wrap=True)
        self._stop()

    def on_exception(
        self, trainer: CallbackTrainer, module: CallbackModule, exception: BaseException
    ) -> None:
        """Close the bar so the traceback is readable."""
        self._stop()

    def teardown(self, trainer: CallbackTrainer, module: CallbackModule, stage: str) -> None:
        """Close the bar if still open."""
        self._stop()
