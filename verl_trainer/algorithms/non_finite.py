"""Bad samples of an RL step — failed reward calls, non-finite values — counted, then an error or dropped.

**Failed reward calls** (:func:`check_reward_failures`): the policy is ``algorithm.reward.on_error``
(:mod:`verl_trainer.rewards.failures`). Every rank scores its own samples, so a failure on one rank must
not raise there alone (the others would wait forever in the next collective): the counts are all-reduced
first, and under ``error`` every rank raises the same :class:`~verl_trainer.rewards.failures.RewardError`,
naming the failed calls of every rank.

**Non-finite rewards, advantages and losses** (:class:`NonFiniteGuard`): reported per step, then an error
or dropped samples.

A NaN/inf reward makes every advantage of its group NaN, every loss NaN and every update a skipped
no-op; a run that only skips would end "successfully" having learned nothing. So, per RL step (on every
rank alike; the counts are all-reduced over the DP group):

* **rewards** (after scoring) and **advantages** (after they are computed): the non-finite samples are
  counted and named (uid, rank, value). ``algorithm.non_finite.policy``:

  - ``error`` (default): :class:`NonFiniteError` on every rank together, naming the step and samples;
  - ``drop_samples``: the samples become padding samples (``schema.mark_padding``: no loss, no metric,
    no denominator) with their reward/advantage set to 0. With a group estimator (GRPO, RLOO) the whole
    group of such a sample goes: its statistics would be computed without it. Logged as
    ``non_finite/rewards``, ``non_finite/advantages`` and ``non_finite/dropped_samples``.

* **losses**: a non-finite loss gives a non-finite grad norm, and the engine skips that optimizer step.
  ``error``: :class:`NonFiniteError` naming the step, the engine and the loss values; ``drop_samples``:
  the step stays skipped (``actor/update_skipped = 1``). With ``precision="16-mixed"`` a step whose
  losses are finite but whose scaled gradients overflowed is skipped by the loss scaler (the scale is
  halved): reported (``update_skipped``, ``<engine>/loss_scale``, ``<engine>/loss_scale_overflows``), never
  an error, and not counted toward ``max_consecutive_skipped_steps``.

A step whose update was skipped for non-finite values (every sample dropped, or a skipped optimizer step)
counts; more than ``algorithm.non_finite.max_consecutive_skipped_steps`` in a row stop the run with a
:class:`NonFiniteError`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NON_FINITE_POLICIES", "NonFiniteConfig", "NonFiniteError"]

NON_FINITE_POLICIES = ("error", "drop_samples")


class NonFiniteError(RuntimeError):
    """Non-finite rewards, advantages or losses under ``policy=error``, or too many skipped steps."""


@dataclass
class NonFiniteConfig:
    """``algorithm.non_finite``: what happens to NaN/inf rewards, advantages and losses.

    Attributes:
        policy: ``error`` (stop, naming the step and the samples) or ``drop_samples`` (train without them).
        max_consecutive_skipped_steps: Steps in a row whose update was skipped for non-finite values
            before the run stops with an error (``0``: the first one stops it).
    """

    policy: str = "error"
    max_consecutive_skipped_steps: int = 3

    def __post_init__(self) -> None:
        if self.policy not in NON_FINITE_POLICIES:
            raise ValueError(
                f"algorithm.non_finite.policy={self.policy!r}; choose one of {NON_FINITE_POLICIES} "
                f"('error' stops the run at the first NaN/inf, 'drop_samples' trains without those samples)"
            )
        if isinstance(self.max_consecutive_skipped_steps, bool) or self.max_consecutive_skipped_steps < 0:
            raise ValueError(
                f"algorithm.non_finite.max_consecutive_skipped_steps={self.max_consecutive_skipped_steps!r} "
                f"must be an int >= 0"
            )
