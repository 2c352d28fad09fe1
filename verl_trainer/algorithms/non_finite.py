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

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict

from verl_trainer.algorithms.distributed import drop_samples
from verl_trainer.data import schema
from verl_trainer.metrics import Metric
from verl_trainer.rewards.compute import FAILED_KEY, RewardFunctions
from verl_trainer.rewards.failures import RewardError, describe_failures, policy_hint
from verl_trainer.utils.distributed import all_gather_object, all_reduce, get_rank
from verl_trainer.utils.listing import first_of

__all__ = ["NON_FINITE_POLICIES", "NonFiniteConfig", "NonFiniteError", "NonFiniteGuard",
           "check_reward_failures"]

NON_FINITE_POLICIES = ("error", "drop_samples")
MAX_LISTED = 8


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


def _fix(config: NonFiniteConfig) -> str:
    if config.policy == "error":
        return ("check the reward function (and the learning rate / precision for losses), or set "
                "algorithm.non_finite.policy=drop_samples to train without those samples")
    return "check the reward function, the learning rate and the precision"


def _losses(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The scalar ``*loss`` values of one micro-batch's metrics."""
    out = {}
    for key, value in metrics.items():
        if not key.endswith("loss"):
            continue
        value = value.aggregate() if isinstance(value, Metric) else value
        if not isinstance(value, torch.Tensor) or value.numel() == 1:
            out[key] = float(value)
    return out


class NonFiniteGuard:
    """Applies :class:`NonFiniteConfig` inside an RL step; keeps the count of skipped steps in a row.

    Args:
        config: The policy and the limit.
        group_estimator: Advantages are normalised within prompt groups (drop whole groups).
    """

    def __init__(self, config: NonFiniteConfig, group_estimator: bool) -> None:
        self.config = config
        self.group_estimator = group_estimator
        self.skipped_in_a_row = 0
        self.dropped = 0  # samples dropped over the DP group in the current step

    def check_samples(self, batch: TensorDict, values: torch.Tensor, what: str, step: int,
                      group: Any, metrics: dict[str, Any]) -> torch.Tensor:
        """Count the real samples whose ``values`` are not finite; raise, or drop them (see module doc).

        A collective over ``group`` (the DP group): call it on every rank.

        Args:
            batch: This rank's batch ``[B]`` (``uid``; ``is_padding`` optional); dropped samples are
                turned into padding samples in place.
            values: ``[B]`` or ``[B, T]`` (token values are checked under ``response_mask``).
            what: ``"rewards"`` or ``"advantages"`` (messages and metric names).
            step: The step being run (1-based, for messages).
            group: The DP process group.
            metrics: Step outputs; ``non_finite/{what}`` (and ``non_finite/dropped_samples``) are added, as
                counts over the DP group.

        Returns:
            ``[B]`` bool: the samples dropped on this rank (all False under ``error`` or when all finite).
        """
        bad, total = _non_finite(batch, values, group)
        metrics[f"non_finite/{what}"] = float(total)  # the same on every rank
        none = torch.zeros_like(bad)
        if total == 0:
            return none
        listed = self._describe(batch, values, bad, group, total)
        if self.config.policy == "error":
            raise NonFiniteError(
                f"step {step}: {total} sample(s) with non-finite {what} ({listed}); {_fix(self.config)}"
            )
        drop, dropped = drop_samples(batch, bad, self.group_estimator, group)
        self.dropped += dropped
        metrics["non_finite/dropped_samples"] = float(dropped)
        if get_rank() == 0:
            print(f"step {step}: dropped {dropped} sample(s) for {total} with non-finite {what} ({listed})",
                  flush=True)
        return drop

    def check_validation(self, batch: TensorDict, scores: torch.Tensor, after_step: int, group: Any,
                         metrics: dict[str, Any]) -> torch.Tensor:
        """Validation's non-finite rewards: counted, then the same policy as training (a collective).

        ``val/non_finite/rewards`` is always logged: the samples of this batch over the DP group, declared
        ``Metric.sum`` (summed over the validation batches, the same value on every rank), so the run's
        validation reports its count. Then ``policy``:

        * ``error``: :class:`NonFiniteError` on every rank together, naming the validation, the step and the
          samples (as training would stop at them);
        * ``drop_samples``: each such sample's prompt group (its ``uid``: the ``val_rollout.n`` responses
          of one prompt) becomes padding, left out of every ``val/`` metric, so ``val/reward/mean`` and
          ``val/pass@k`` are over the prompts whose rewards are all finite; logged as
          ``val/non_finite/dropped_samples`` (``Metric.sum``). The training counters are not touched.

        Args:
            batch: This rank's scored validation batch ``[B]`` (``uid``, ``is_padding``); changed in place.
            scores: ``[B]`` rewards; a dropped sample's is set to 0.
            after_step: Training steps done before this validation (``trainer.global_step``), for messages.
            group: The DP process group.
            metrics: The validation step's outputs.

        Returns:
            ``[B]`` bool: the samples dropped on this rank.
        """
        bad, total = _non_finite(batch, scores, group)
        metrics["val/non_finite/rewards"] = Metric.sum(float(total))
        if total == 0:
            if self.config.policy != "error":
                metrics["val/non_finite/dropped_samples"] = Metric.sum(0.0)
            return torch.zeros_like(bad)
        listed = self._describe(batch, scores, bad, group, total)
        if self.config.policy == "error":
            raise NonFiniteError(
                f"validation after step {after_step}: {total} sample(s) with non-finite rewards ({listed}); "
                f"check the reward function, or set algorithm.non_finite.policy=drop_samples to leave those "
                f"prompts out of the validation metrics (and those samples out of training)")
        drop, dropped = drop_samples(batch, bad, True, group)
        scores[drop] = 0.0
        metrics["val/non_finite/dropped_samples"] = Metric.sum(float(dropped))
        if get_rank() == 0:
            print(f"validation after step {after_step}: left out {dropped} sample(s) for {total} with "
                  f"non-finite rewards ({listed})", flush=True)
        return drop

    @staticmethod
    def _describe(batch: TensorDict, values: torch.Tensor, bad: torch.Tensor, group: Any, total: int) -> str:
        """``uid 3 on rank 1: nan, ... and 2 more``: the first bad samples of the DP group (of ``total``)."""
        uids = batch[schema.UID] if schema.UID in batch.keys() else torch.arange(bad.numel())
        rows = bad.nonzero().flatten()[:MAX_LISTED].tolist()
        shown = []
        for i in rows:
            v = values[i]
            if v.dim():
                v = v[~torch.isfinite(v)][0]
            shown.append((int(uids[i]), float(v)))
        everyone = all_gather_object((get_rank(), shown), group)
        parts = [f"uid {uid} on rank {rank}: {value}" for rank, items in everyone for uid, value in items]
        return first_of(parts, MAX_LISTED, total=total)

    def check_update(self, engine_name: str, grad_norm: float, micro_batch_metrics: list[Mapping[str, Any]],
                     step: int, loss_scale_overflow: bool = False) -> bool:
        """After an engine's updates: ``True`` when one was skipped for a non-finite loss / grad norm.

        The grad norm is the same on every rank (reduced over the engine's group), so every rank decides
        alike. Raises :class:`NonFiniteError` under ``policy=error``, except for a float16 loss-scale
        overflow (``loss_scale_overflow``: finite losses, the scaled gradients overflowed; the scaler
        lowers the scale and training goes on), which is only reported.
        """
        if math.isfinite(grad_norm):
            return False
        if loss_scale_overflow:
            return True
        if self.config.policy == "error":
            losses = sorted({f"{k}={v:.4g}" for mb in micro_batch_metrics for k, v in _losses(mb).items()
                             if not math.isfinite(v)})
            raise NonFiniteError(
                f"step {step}: {engine_name} grad norm is {grad_norm} (non-finite loss or gradient: "
                f"{', '.join(losses) or 'the losses were finite; the gradient overflowed'}); the optimizer "
                f"step would be skipped; {_fix(self.config)}"
            )
        return True

    def end_step(self, skipped: bool, step: int) -> None:
        """Count a step skipped for non-finite values; too many in a row raise :class:`NonFiniteError`."""
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        if self.skipped_in_a_row > self.config.max_consecutive_skipped_steps:
            raise NonFiniteError(
                f"step {step}: {self.skipped_in_a_row} steps in a row skipped their update for non-finite "
                f"rewards, advantages or losses (algorithm.non_finite.max_consecutive_skipped_steps="
                f"{self.config.max_consecutive_skipped_steps}); the run is not training; {_fix(self.config)}"
            )


def _non_finite(batch: TensorDict, values: torch.Tensor, group: Any) -> tuple[torch.Tensor, int]:
    """``([B] bool`` real samples with a non-finite value, their count over ``group``)``; a collective.

    ``values`` ``[B]``, or ``[B, T]`` checked under ``response_mask``.
    """
    if values.dim() == 2:
        bad = (~torch.isfinite(values) & batch[schema.RESPONSE_MASK].bool()).any(-1)
    else:
        bad = ~torch.isfinite(values)
    bad = bad & schema.real_mask(batch)
    return bad, int(all_reduce(bad.sum().to(torch.float64), group).item())


def check_reward_failures(reward_fn: RewardFunctions, batch: TensorDict, scores: torch.Tensor,
                          info: dict[str, torch.Tensor], step: int, group: Any, metrics: dict[str, Any],
                          group_estimator: bool = False, prefix: str = "reward") -> int:
    """Count, then raise or drop, the samples whose reward call failed (a collective over ``group``).

    Args:
        reward_fn: The functions that scored ``batch`` (their ``failures`` are the last call's).
        batch: This rank's scored batch ``[B]`` (``uid``, ``is_padding``); dropped samples become padding.
        scores: ``[B]`` scores; a dropped sample's is set to 0.
        info: The scoring's per-sample extras (``FAILED_KEY`` ``[B]``).
        step: The step (1-based), for messages.
        group: The DP process group.
        metrics: Step outputs: ``{prefix}/errors`` and ``{prefix}/timeouts`` (counts over the group) are
            set, and ``{prefix}/dropped_samples`` under ``drop``.
        group_estimator: Drop a failed sample's whole prompt group (its advantages need all of it).
        prefix: Metric prefix (``val/reward`` in validation).

    Returns:
        The samples dropped over the group (0 unless ``on_error="drop"``).

    Raises:
        RewardError: Under ``on_error="error"``, on every rank, when any rank had a failed call.
    """
    real = schema.real_mask(batch)
    mine = [f for f in reward_fn.failures if bool(real[f.index])]
    timeouts = sum(f.timeout for f in mine)
    counts = torch.tensor([len(mine) - timeouts, timeouts], dtype=torch.float64)
    errors, timed_out = (int(v) for v in all_reduce(counts, group).tolist())
    metrics[f"{prefix}/errors"], metrics[f"{prefix}/timeouts"] = float(errors), float(timed_out)
    if errors + timed_out == 0 or reward_fn.on_error == "zero":
        return 0
    if reward_fn.on_error == "error":
        uids = batch[schema.UID].tolist() if schema.UID in batch.keys() else None
        rank = get_rank()
        described = [f.describe(f", uid {uids[f.index]}, rank {rank}" if uids else f", rank {rank}")
                     for f in mine[:4]]
        everyone = [d for part in all_gather_object(described, group) for d in part]
        raise RewardError(f"step {step}: {errors + timed_out} reward call(s) failed ({timed_out} timed out): "
                          f"{describe_failures(everyone, errors + timed_out)}; {policy_hint()}")
    drop, dropped = drop_samples(batch, info[FAILED_KEY].bool() & real, group_estimator, group)
    scores[drop] = 0.0
    metrics[f"{prefix}/dropped_samples"] = float(dropped)
    if get_rank() == 0:
        print(f"step {step}: dropped {dropped} sample(s) for {errors + timed_out} failed reward call(s)",
              flush=True)
    return dropped
