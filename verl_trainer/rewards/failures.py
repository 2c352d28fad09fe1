"""Reward calls that fail: counted, described, and handled by ``algorithm.reward.on_error``.

A reward function **fails** on a sample when it raises, runs past its time limit (a ``TimeoutError``: the
call ran past ``algorithm.reward.timeout_s`` (:data:`DEFAULT_TIMEOUT_S`), or a function's own limit such as
:class:`~verl_trainer.rewards.RewardTimeoutError`), or returns something that is not a number (``None``
from a verl-style function, a string, a dict without ``"score"``). A non-finite number is not a failure
here: it goes to the non-finite guard (``non_finite/rewards``, ``algorithm.non_finite``).

Policies (:data:`REWARD_ERROR_POLICIES`):

* ``error`` (default): :class:`RewardError` naming the reward function, the data source and the sample
  (raised on every rank together in training: the failures are counted over the DP group first);
* ``drop``: the sample (with a group estimator, its whole group) becomes a padding sample — no loss, no
  metric, no denominator;
* ``zero``: the sample scores 0 for that function.

Every step logs the failure and timeout counts over the DP group (names: docs/metrics.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from verl_trainer.utils.listing import first_of

__all__ = ["DEFAULT_TIMEOUT_S", "MAX_LISTED", "REWARD_ERROR_POLICIES", "RewardError", "RewardFailure",
           "check_on_error", "check_timeout", "describe_failures"]

REWARD_ERROR_POLICIES = ("error", "drop", "zero")
DEFAULT_TIMEOUT_S = 60.0
"""The default ``algorithm.reward.timeout_s``: the longest one reward-function call may take."""
MAX_LISTED = 4
"""Failures a message names (the rest are counted)."""


class RewardError(Exception):
    """A reward function failed under ``algorithm.reward.on_error=error``.

    Not a ``RuntimeError``: the trainer's failure handling reads a ``RuntimeError`` that mentions a time-out
    as a communication failure, and a reward call that timed out is not one.
    """


@dataclass
class RewardFailure:
    """One failed reward call on one sample.

    Attributes:
        function: The reward function's name.
        index: The sample's row in the scored batch.
        data_source: Its ``data_source``.
        response: The response text (cut for messages).
        timeout: Whether the call ran past its time limit.
        message: What went wrong (the exception, or the value returned).
    """

    function: str
    index: int
    data_source: str
    response: str
    timeout: bool
    message: str

    def describe(self, where: str = "") -> str:
        """``reward function f on sample 3 (data source 'gsm8k', response '...'): ValueError: ...``."""
        kind = "timed out" if self.timeout else "failed"
        return (f"reward function {self.function} {kind} on sample {self.index}{where} (data source "
                f"{self.data_source!r}, response {self.response[:120]!r}): {self.message[:300]}")


def describe_failures(failures: list[str], total: int) -> str:
    """The first :data:`MAX_LISTED` descriptions, and how many more there were."""
    return first_of(failures, MAX_LISTED, "; ", total)


def check_on_error(policy: str) -> None:
    """Raise ``ValueError`` unless ``policy`` is one of :data:`REWARD_ERROR_POLICIES`."""
    if policy not in REWARD_ERROR_POLICIES:
        raise ValueError(f"algorithm.reward.on_error={policy!r}; choose one of {REWARD_ERROR_POLICIES} "
                         "(error: stop naming the sample; drop: train without it; zero: score it 0)")


def check_timeout(timeout_s: float | None) -> None:
    """Raise ``ValueError`` unless ``timeout_s`` is ``None`` or a finite number of seconds > 0."""
    if timeout_s is None:
        return
    number = isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
    if not (number and 0 < timeout_s < math.inf):
        raise ValueError(f"algorithm.reward.timeout_s={timeout_s!r} must be a number of seconds in (0, inf) "
                         "(the longest one reward-function call may take: one sample for a verl-style "
                         f"function, the batch for a TRL-style one; default {DEFAULT_TIMEOUT_S:g}), or null "
                         "(no limit: calls run on the calling thread, and a hanging function stalls the run)")


def policy_hint() -> str:
    """How to choose another policy (for messages)."""
    return ("fix the reward function, or set algorithm.reward.on_error=drop (train without those samples) "
            "or zero (score them 0)")
