"""Environments: multi-step tasks that answer the model's messages (NeMo-RL's / TRL's environments).

One :class:`Environment` object serves one trajectory: :meth:`Environment.reset` gets the prompt row,
:meth:`Environment.step` gets each model message (the decoded text of one assistant turn that made no tool
call) and returns a :class:`StepResult`. A not-done step's observation is appended as a ``user`` message
through the chat template; rewards of all steps are summed into the trajectory's reward.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Environment", "StepResult"]


@dataclass(frozen=True)
class StepResult:
    """What the environment answers to one model message.

    Attributes:
        observation: Text shown to the model as the next ``user`` message (ignored when ``done``).
        reward: This step's reward (summed over the trajectory).
        done: The episode ended.
    """

    observation: str = ""
    reward: float = 0.0
    done: bool = False


class Environment:
    """A multi-step task; subclass it and name the class in ``multi_turn.environment``.

    The class is instantiated once per trajectory (no arguments), so instance attributes are that
    trajectory's state. Steps of different trajectories run concurrently in threads.
    """

    def reset(self, row: Mapping[str, Any]) -> None:
        """A trajectory starts; ``row``: its prompt's ``ground_truth``, ``data_source``, ``extra_info``."""

    def step(self, message: str) -> StepResult:
        """Answer one model message."""
        raise NotImplementedError

    def close(self) -> None:
        """The trajectory ended: free what :meth:`reset` took."""
