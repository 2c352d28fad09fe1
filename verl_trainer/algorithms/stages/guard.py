"""The RL step's guard: failed reward calls, non-finite values and dropped samples, under one policy.

The policies are :mod:`verl_trainer.algorithms.non_finite`'s (``algorithm.non_finite``) and
:mod:`verl_trainer.rewards.failures`'s (``algorithm.reward.on_error``). :class:`StepGuard` applies them
in an RL step, at the three places where values appear:

* :meth:`StepGuard.rewards` — called by the scorer, before the scores are placed on tokens and their
  metrics taken: failed calls, then non-finite rewards (an error on every rank together, or the samples,
  with their whole group under a group estimator, turned into padding with score 0);
* :meth:`StepGuard.check` — the step's guard pass, on the batch chosen for the update: non-finite
  advantages, padding rows' values zeroed (a masked NaN still poisons a loss), and whether any rank has a
  sample left to train on;
* :meth:`StepGuard.finish` — after the update: a skipped optimizer step (non-finite grad norm; a float16
  loss-scale overflow is reported, not an error), ``actor/update_skipped``, and the count of skipped steps
  in a row (more than ``max_consecutive_skipped_steps`` stop the run).

Every check is a collective over the DP group (the counts are all-reduced), so every rank raises or
drops alike.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_trainer.algorithms.non_finite import NonFiniteConfig, NonFiniteError
from verl_trainer.algorithms.stages import StepMetrics
from verl_trainer.data import schema
from verl_trainer.metrics import Metric
from verl_trainer.rewards.compute import FAILED_KEY, RewardFunctions
from verl_trainer.rewards.failures import RewardError, describe_failures, policy_hint
from verl_trainer.utils.distributed import all_gather_object, all_reduce, get_rank
from verl_trainer.utils.listing import first_of

__all__ = ["NonFiniteGuard", "StepGuard", "check_reward_failures", "drop_samples"]

MAX_LISTED = 8


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
                      group: Any, metrics: StepMetrics) -> torch.Tensor:
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
                         metrics: StepMetrics) -> torch.Tensor:
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


    def single_update(self, engine_name: str, out: Mapping[str, Any], step: int) -> dict[str, Any]:
        """Check a step of one engine update (``train_batch``'s output ``out``) and return its outputs.

        :meth:`check_update` then :meth:`end_step` (a float16 loss-scale overflow skips the step without
        counting toward the limit: it is no broken run). Returns ``micro_batches``, ``train/grad_norm``,
        ``train/lr``, ``train/update_skipped`` (1.0: skipped) and, with a loss scaler, ``train/loss_scale``.

        Raises:
            NonFiniteError: As :meth:`check_update` and :meth:`end_step`.
        """
        overflow = bool(out.get("loss_scale_overflow", False))
        skipped = self.check_update(engine_name, float(out["grad_norm"]), out["metrics"], step,
                                    loss_scale_overflow=overflow)
        self.end_step(skipped and not overflow, step)
        outputs = {"micro_batches": out["metrics"], "train/grad_norm": out["grad_norm"],
                   "train/lr": out["lr"], "train/update_skipped": float(skipped)}
        if out.get("loss_scale") is not None:
            outputs["train/loss_scale"] = out["loss_scale"]
        return outputs

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


def drop_samples(batch: TensorDict, bad: torch.Tensor, group_estimator: bool, group=None
                 ) -> tuple[torch.Tensor, int]:
    """Mark ``bad`` samples (and, for a group estimator, their whole prompt groups) as padding.

    Args:
        batch: This rank's step batch ``[B]`` (``uid``, ``is_padding``), changed in place.
        bad: ``[B]`` bool, the samples to drop on this rank (real ones only).
        group_estimator: Drop every sample that shares a ``uid`` with a bad one (its advantages need the
            whole group).
        group: The DP process group (``None``: the default group, or one process).

    Returns:
        ``([B] bool`` mask of what was dropped here, samples dropped over the DP group``)``.
    """
    drop = bad
    if group_estimator and schema.UID in batch.keys():
        uids = batch[schema.UID]
        drop = torch.isin(uids, uids[bad]) & schema.real_mask(batch)
    schema.mark_padding(batch, drop)
    return drop, int(all_reduce(drop.sum().to(torch.float64), group).item())


def check_reward_failures(reward_fn: RewardFunctions, batch: TensorDict, scores: torch.Tensor,
                          info: dict[str, torch.Tensor], step: int, group: Any, metrics: StepMetrics,
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


_ZEROED = (schema.ADVANTAGES, schema.RETURNS, schema.VALUES, schema.TOKEN_LEVEL_REWARDS,
           schema.TOKEN_LEVEL_SCORES)
"""Per-token values set to 0 on padding rows once samples were dropped (a masked NaN still poisons a loss:
``NaN * 0 = NaN``)."""


class StepGuard:
    """The policies for bad samples in one RL step (see the module docstring); keeps the skipped-step count.

    Args:
        config: ``algorithm.non_finite``.
        reward_fn: The reward functions whose failed calls :meth:`rewards` counts.
        group_estimator: Advantages are normalised within prompt groups: a bad sample drops its group.
        dp_group: The DP process group (``None``: one process).

    Invariant: :attr:`dropped` counts the samples dropped over the DP group since the step began (the same
    on every rank); :meth:`finish` ends the step and resets it.
    """

    def __init__(self, config: NonFiniteConfig, reward_fn: RewardFunctions, group_estimator: bool,
                 dp_group: dist.ProcessGroup | None = None) -> None:
        self.non_finite = NonFiniteGuard(config, group_estimator)
        self.reward_fn = reward_fn
        self.group_estimator = group_estimator
        self.dp_group = dp_group

    @property
    def dropped(self) -> int:
        """Samples dropped over the DP group in the current step."""
        return self.non_finite.dropped

    def rewards(self, batch: TensorDict, scores: torch.Tensor, info: dict[str, torch.Tensor], step: int,
                metrics: StepMetrics, what: str = "rewards") -> None:
        """Failed reward calls (``reward.on_error``), then non-finite scores (``non_finite.policy``).

        Args:
            batch: This rank's scored batch ``[B]``; dropped samples become padding in place.
            scores: ``[B]``; a dropped sample's is set to 0.
            info: The scoring's per-sample extras (``FAILED_KEY``).
            step: The step being run (1-based, for messages).
            metrics: Receives ``reward/errors``, ``reward/timeouts``, ``non_finite/{what}`` and the dropped
                counts.
            what: The values' name in messages and metrics (``baseline_rewards`` for ReMax's greedy ones).

        Raises:
            RewardError: A failed call under ``on_error="error"`` (on every rank).
            NonFiniteError: A non-finite score under ``policy="error"`` (on every rank).
        """
        self.non_finite.dropped += check_reward_failures(self.reward_fn, batch, scores, info, step,
                                                         self.dp_group, metrics, self.group_estimator)
        dropped = self.non_finite.check_samples(batch, scores, what, step, self.dp_group, metrics)
        scores[dropped] = 0.0

    def validation_rewards(self, batch: TensorDict, scores: torch.Tensor, info: dict[str, torch.Tensor],
                           step: int, metrics: StepMetrics) -> None:
        """Validation's failed calls (``val/reward/errors``, ...), non-finite scores (``val/non_finite/*``).

        The same policies as training (see :meth:`NonFiniteGuard.check_validation`); the step's counters are
        not touched. ``step``: the training step after the validation's (1-based, for messages).
        """
        check_reward_failures(self.reward_fn, batch, scores, info, step, self.dp_group, metrics,
                              prefix="val/reward")
        self.non_finite.check_validation(batch, scores, step - 1, self.dp_group, metrics)

    def drop_orphans(self, batch: TensorDict, orphans: torch.Tensor, dropped_before: int) -> None:
        """Drop ``orphans`` ``[B]`` (samples whose ReMax baseline was dropped) when any was dropped since.

        ``dropped_before``: :attr:`dropped` before the baseline was scored (a count the same on every rank,
        so every rank reaches the collective alike).
        """
        if self.non_finite.dropped > dropped_before:
            self.non_finite.dropped += drop_samples(batch, orphans, False, self.dp_group)[1]

    def check(self, data: TensorDict, trainable: bool, step: int, metrics: StepMetrics) -> bool:
        """The guard pass on the batch chosen for the update; whether the step updates.

        Non-finite advantages are an error or dropped (``non_finite/advantages``); once any sample of the
        step was dropped, padding rows' values are zeroed and the update is skipped when no rank has a real
        sample left (a collective, reached alike on every rank).

        Args:
            data: This rank's tensor-only update batch ``[B, T]``, changed in place.
            trainable: Whether the sample selection left anything to train on (every rank alike).
            step: The step being run (1-based, for messages).
            metrics: The step's outputs.

        Raises:
            NonFiniteError: A non-finite advantage under ``policy="error"``.
        """
        adv = data[schema.ADVANTAGES]
        self.non_finite.check_samples(data, adv, "advantages", step, self.dp_group, metrics)
        if not self.non_finite.dropped:
            return trainable
        real = schema.real_mask(data).unsqueeze(-1)
        for key in _ZEROED:
            if key in data.keys():
                data[key] = torch.where(real, data[key], torch.zeros((), dtype=data[key].dtype))
        left = all_reduce(torch.tensor(float(schema.num_real(data))), self.dp_group)
        self.all_dropped = float(left) == 0.0
        return trainable and not self.all_dropped

    all_dropped: bool = False
    """Whether every sample of the current step was dropped (set by :meth:`check`)."""

    def finish(self, outputs: Mapping[str, Any], updated: bool, step: int, metrics: StepMetrics) -> None:
        """End the step: skipped optimizer steps, ``actor/update_skipped``, the skipped-steps count.

        Args:
            outputs: The updater's outputs (``{engine}/grad_norm``, ``{engine}/loss_scale_overflows``,
                ``{engine}/skipped_updates``, ``{engine}_micro_batches``).
            updated: Whether the step ran its update.
            step: The step (1-based, for messages).
            metrics: Receives ``actor/update_skipped``.

        Raises:
            NonFiniteError: A non-finite loss under ``policy="error"``, or too many skipped steps in a row.
        """
        skipped, overflow_only = self._updates_skipped(outputs, step) if updated else (False, False)
        # a float16 overflow skip is reported (update_skipped) but is no sign of a broken run
        self.non_finite.end_step(self.all_dropped or (skipped and not overflow_only), step)
        metrics["actor/update_skipped"] = 0.0 if updated and not skipped else 1.0
        self.non_finite.dropped, self.all_dropped = 0, False

    def _updates_skipped(self, outputs: Mapping[str, Any], step: int) -> tuple[bool, bool]:
        """Whether an engine skipped an update, and whether all skips were float16 loss-scale overflows."""
        skipped, overflow_only = False, True
        for name in ("critic", "actor"):
            if f"{name}/grad_norm" in outputs:
                overflows = outputs.get(f"{name}/loss_scale_overflows", 0)
                only = overflows > 0 and overflows == outputs.get(f"{name}/skipped_updates", 0)
                engine_skipped = self.non_finite.check_update(
                    name, float(outputs[f"{name}/grad_norm"]), outputs.get(f"{name}_micro_batches", []), step,
                    loss_scale_overflow=only)
                skipped |= engine_skipped
                overflow_only &= only or not engine_skipped
        return skipped, skipped and overflow_only
