"""TRL's run-level reward arguments: ``trainer_state`` and ``log_metric``.

TRL calls a reward function with ``trainer_state`` (its ``TrainerState``: ``global_step``, ``epoch``,
``max_steps``) and ``log_metric(name, value)`` besides the per-sample columns; :func:`trl_run_kwargs` builds
both for a step here. ``completion_ids`` (per sample) is added by ``score_batch``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from verl_trainer.metrics import Metric

__all__ = ["RewardTrainerState", "trl_run_kwargs"]


@dataclass(frozen=True)
class RewardTrainerState:
    """What TRL's ``trainer_state`` offers a reward function.

    Attributes:
        global_step: Optimizer steps done before this one.
        epoch: The training epoch (0-based).
        max_steps: The run's step limit (``-1``: set by epochs).
    """

    global_step: int
    epoch: int
    max_steps: int


def trl_run_kwargs(trainer: Any, metrics: dict[str, Any]) -> dict[str, Any]:
    """``trainer_state`` and ``log_metric`` for one scoring call.

    ``log_metric(name, value)`` sets ``name`` in the step's ``metrics`` (the step's last value) as a MEAN over
    the ranks (TRL averages over processes); call it on every rank, as ``self.log``.
    """

    def log_metric(name: str, value: float) -> None:
        metrics[name] = Metric.mean(float(value))

    log: Callable[[str, float], None] = log_metric
    if trainer is None:
        return {"trainer_state": RewardTrainerState(0, 0, -1), "log_metric": log}
    state = RewardTrainerState(trainer.global_step, trainer.current_epoch, trainer.max_steps)
    return {"trainer_state": state, "log_metric": log}
