"""How far a run is: the one record of a stage's progress, owned by its loops.

The fit loop advances it (``global_step``, the loader's epoch and position) and reads its stop request
(``should_stop``, set by callbacks such as ``EarlyStopping`` and by the ``max_time`` budget); the
evaluation loop sets its flags. :class:`~verl_trainer.Trainer` exposes the fields as its Lightning
attributes (``trainer.global_step``, ``current_epoch``, ``should_stop``, ...), reading and writing here.
A checkpoint saves :meth:`Progress.state_dict` and a resume loads it back, so a resumed run continues at
the same step and loader batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl_trainer.data.sharded_loader import ShardedLoader

__all__ = ["Progress"]


@dataclass
class Progress:
    """The progress of the current (or last) stage.

    Attributes:
        stage: ``"fit"`` / ``"validate"`` / ``"test"`` / ``"predict"`` while one runs, else ``None``.
        global_step: Optimizer steps done (restored from a checkpoint on resume).
        should_stop: A stop request; the fit loop honours it after ``min_steps`` / ``min_epochs``.
        train_loader: The training data: its epoch and position within the epoch are the loop's.
        sanity_checking: Inside the sanity-check validation at the start of fit.
        evaluating: Inside a validation / test / predict loop (``self.log`` logs per run there).
        last_validation: ``(global_step, reduced metrics)`` of the latest validation pass (sanity checks
            excluded).
    """

    stage: str | None = None
    global_step: int = 0
    should_stop: bool = False
    train_loader: ShardedLoader | None = None
    sanity_checking: bool = False
    evaluating: bool = False
    last_validation: tuple[int, dict[str, float]] | None = None

    @property
    def current_epoch(self) -> int:
        """The training epoch (0-based; 0 without training data)."""
        return int(self.train_loader.epoch) if self.train_loader is not None else 0

    def state_dict(self) -> dict[str, Any]:
        """The step and the loader position, as a checkpoint stores them."""
        loader = self.train_loader
        return {"global_step": self.global_step, "data": loader.state_dict() if loader is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s values (the loader position only when both have one)."""
        self.global_step = int(state["global_step"])
        if self.train_loader is not None and state.get("data") is not None:
            self.train_loader.load_state_dict(state["data"])
