"""The stages of an RL step, each handed only what it uses, none the module.

A stage gets engines, configs, the rollout, the reward functions, the DP group: never the module.

One training step (:meth:`~verl_trainer.algorithms.rl.RLModule.training_step`) runs them in a straight
line::

    rollout (rollout.py)  →  score (scoring.py)  →  advantages (advantages.py)  →  on_rollout_end
      →  select (advantages.py)  →  guard (guard.py)  →  update (update.py, on_before_update between its
      two halves)  →  sync (rollout.py)  →  guard.finish

A feature is a part plugged into a stage, not a branch of the step: ReMax's greedy baseline is a rollout
part and a scoring part (``greedy_baseline.py``), one-step-off a wrapper of the rollout stage
(``one_step_off.py``), the reward model and the train-generation log scoring parts, DAPO's dynamic
sampling a selection part (``dapo.py``), PPO's critic an advantage part and an update part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl_trainer.algorithms.stages.guard import StepGuard
from verl_trainer.algorithms.stages.signal import Advantages, Scorer
from verl_trainer.algorithms.stages.update import Updater

__all__ = ["RLStages"]


@dataclass
class RLStages:
    """The stages of one RL module, built once its engines exist."""

    rollout: Any
    """A :class:`~verl_trainer.algorithms.stages.rollout.RolloutStage` or a wrapper of one with the same
    ``generate`` / ``after_update`` / ``before_validation`` / ``weights``."""
    scorer: Scorer
    advantages: Advantages
    guard: StepGuard
    updater: Updater
