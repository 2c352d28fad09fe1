"""The learning signal of a rollout batch: its rewards (:class:`Scorer`), then its advantages.

:meth:`Scorer.score` runs, on this rank's rollout batch::

    reward functions (under ``reward.timeout_s``)  [+ the reward model's weighted score, its part]
      → the guard's reward checks (failed calls, non-finite scores: an error, or the samples dropped)
      → token_level_scores, reward metrics          [+ the environment's reward in multi-turn]
      [+ DAPO's overlong shaping]  → token_level_rewards, response_length metrics
      → its parts: the train-generation log, ReMax's baseline scoring (reward_baselines)

Every step is a collective where it counts over the DP group (reward model, checks), so call it on every
rank. Validation (:meth:`Scorer.validate`) scores alike under ``val/reward``.

:class:`Advantages` then runs two parts a recipe plugs in:

* ``compute(batch, scores, metrics)`` writes ``advantages`` (and ``returns``, ``values``) ``[B, T]``:
  :class:`EstimatorAdvantages` (GRPO: a registered estimator on the groups of this rank; ReMax reads the
  ``reward_baselines`` the scorer wrote) or PPO's critic part (values, then GAE);
* ``select(batch, scores, metrics) -> (batch, trainable)`` chooses the samples (default: all;
  DAPO's dynamic sampling, :class:`~verl_trainer.algorithms.dapo.DynamicSampling`).

An estimator that whitens over the batch it is handed has that whitening redone over the whole DP batch
(:func:`estimator_advantages`, :func:`global_masked_whiten`), so the advantages do not depend on the dp
size: each rank contributes masked sums, a few numbers all-reduced.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_trainer.algorithms.config import OverlongBufferConfig
from verl_trainer.algorithms.dapo import overlong_penalty
from verl_trainer.algorithms.stages import StepMetrics
from verl_trainer.algorithms.stages.guard import StepGuard
from verl_trainer.core_algos.advantages import Estimator
from verl_trainer.data import schema
from verl_trainer.metrics import Metric, sample_stats, token_stats
from verl_trainer.rewards.compute import (
    BatchScores,
    RewardFunctions,
    place_scores,
    score_responses,
    token_level_scores,
)
from verl_trainer.rollout import AGENT_INFO
from verl_trainer.rollout.agent_loop import agent_rewards_and_metrics
from verl_trainer.rollout.config import RolloutConfig
from verl_trainer.utils.distributed import all_reduce

__all__ = ["Advantages", "EstimatorAdvantages", "ModelScores", "ScorePart", "Scorer", "estimator_advantages",
           "global_masked_whiten", "keep_all", "response_length_metrics"]


def response_length_metrics(batch: TensorDict, max_len: int,
                            prefix: str = "response_length") -> dict[str, Metric]:
    """Mean/min/max response length and the fraction cut at ``max_len`` (real samples only)."""
    lens = batch[schema.RESPONSE_LEN].to(torch.float32)[schema.real_mask(batch)]
    count = lens.numel()
    clipped = (lens >= max_len).float().mean() if count else torch.zeros(())
    return {**sample_stats(lens, prefix), f"{prefix}/clip_ratio": Metric.mean(clipped, weight=count)}


class ModelScores(Protocol):
    """A scored batch's extra score (the reward model): added to ``scores`` in place, before the checks."""

    def __call__(self, batch: TensorDict, scores: torch.Tensor, info: dict[str, torch.Tensor],
                 metrics: StepMetrics, prefix: str) -> None:
        """Add to ``scores`` ``[B]`` in place; ``info`` and ``metrics`` (under ``prefix``) get its own."""


class ScorePart(Protocol):
    """Runs after a rollout batch was scored (a training step only)."""

    def after_score(self, scorer: Scorer, batch: TensorDict, scores: torch.Tensor, step: int,
                    metrics: StepMetrics) -> None:
        """``scores``: ``[B]`` the shaped rewards; ``step``: the step being run (1-based)."""


class Scorer:
    """The scoring stage (see the module docstring).

    Args:
        reward_fn: The reward functions.
        guard: Applies ``reward.on_error`` and ``non_finite.policy`` to the scores.
        rollout: ``algorithm.rollout`` (``max_new_tokens``, ``multi_turn.reward_weight``).
        overlong: ``algorithm.reward.overlong_buffer`` (DAPO's shaping when enabled).
        model: The reward model's part (``None``: no reward model).
        trl_kwargs: ``trl_kwargs(metrics)``: the run's state for TRL-style functions (``None``: none of
            the functions is TRL-style).
        parts: Run after a training batch is scored, in order.
    """

    def __init__(self, reward_fn: RewardFunctions, guard: StepGuard, rollout: RolloutConfig,
                 overlong: OverlongBufferConfig, model: ModelScores | None = None,
                 trl_kwargs: Callable[[StepMetrics], Mapping[str, Any]] | None = None,
                 parts: Sequence[ScorePart] = ()) -> None:
        self.reward_fn = reward_fn
        self.guard = guard
        self.rollout = rollout
        self.overlong = overlong
        self.model = model
        self.trl_kwargs = trl_kwargs
        self.parts = list(parts)

    def score(self, batch: TensorDict, step: int, metrics: StepMetrics) -> torch.Tensor:
        """Rewards of a training batch: writes ``token_level_scores`` / ``token_level_rewards``; adds metrics.

        Args:
            batch: This rank's rollout batch ``[B]``; dropped samples become padding in place.
            step: The step being run (1-based, for messages).
            metrics: The step's outputs.

        Returns:
            ``[B]`` the (shaped) rewards the advantages are computed from.
        """
        scores = self.rewards(batch, step, metrics)
        metrics.update(response_length_metrics(batch, self.rollout.max_new_tokens))
        rewards = token_level_scores(scores, batch[schema.RESPONSE_MASK])
        batch[schema.TOKEN_LEVEL_SCORES] = rewards
        batch[schema.TOKEN_LEVEL_REWARDS] = rewards.clone()
        for part in self.parts:
            part.after_score(self, batch, scores, step, metrics)
        return scores

    def rewards(self, batch: TensorDict, step: int, metrics: StepMetrics, what: str = "rewards"
                ) -> torch.Tensor:
        """``[B]`` rewards of a rollout batch: every part of the reward, checked (a collective).

        ``what`` names the values in messages and in ``non_finite/{what}`` (``baseline_rewards`` for ReMax's
        greedy responses).
        """
        trl_kwargs = self.trl_kwargs(metrics) if self.trl_kwargs is not None else None
        scores, info = score_responses(batch, self.reward_fn, raise_on_error=False, trl_kwargs=trl_kwargs)
        if self.model is not None:
            self.model(batch, scores, info, metrics, "reward")
        self.guard.rewards(batch, scores, info, step, metrics, what)
        metrics.update(place_scores(batch, scores, info).metrics)
        if AGENT_INFO in batch.keys():  # multi-turn: the environment's and the tools' trajectory reward
            agent_rewards, agent_metrics = agent_rewards_and_metrics(batch)
            scores = scores + self.rollout.multi_turn.reward_weight * agent_rewards.to(scores)
            metrics.update(agent_metrics)
        if self.overlong.enable:
            penalty = overlong_penalty(batch[schema.RESPONSE_LEN], self.rollout.max_new_tokens,
                                       self.overlong.len, self.overlong.penalty_factor)
            scores = scores + penalty
            metrics["reward/overlong_penalty"] = Metric.mean(penalty.mean(), weight=penalty.numel())
        return scores

    def validate(self, batch: TensorDict, step: int, metrics: StepMetrics) -> BatchScores:
        """Scores of a validation batch under ``val/reward`` (failed calls and non-finite scores checked).

        Args:
            batch: This rank's validation rollout batch; dropped prompts become padding in place.
            step: The step the validation follows plus one (1-based, for messages).
            metrics: The validation step's outputs (the reward metrics are added).
        """
        scores, info = score_responses(batch, self.reward_fn, raise_on_error=False)
        if self.model is not None:
            self.model(batch, scores, info, metrics, "val/reward")
        self.guard.validation_rewards(batch, scores, info, step, metrics)
        result = place_scores(batch, scores, info, "val/reward")
        metrics.update(result.metrics)
        return result


ComputePart = Callable[[TensorDict, torch.Tensor, StepMetrics], None]
"""``compute(batch, scores, metrics)``: writes the advantages into ``batch``; adds metrics."""
SelectPart = Callable[[TensorDict, torch.Tensor, StepMetrics], tuple[TensorDict, bool]]
"""``select(batch, scores, metrics) -> (batch, trainable)``; ``trainable`` the same on every rank."""


def global_masked_whiten(values: torch.Tensor, mask: torch.Tensor,
                         group: dist.ProcessGroup | None = None, shift_mean: bool = True) -> torch.Tensor:
    """Whiten ``values`` with the masked mean and unbiased variance of the whole DP batch.

    Equals :func:`verl_trainer.core_algos.masked_whiten` of the concatenation of every rank's batch
    (to float round-off: the statistics are accumulated in float64): ``(x - mean) / sqrt(var + 1e-8)``.
    Two all-reduces of two numbers each.

    Args:
        values: ``[B, T]`` on this rank.
        mask: ``[B, T]`` bool or 0/1.
        group: The DP group (``None``: the default group, if any).
        shift_mean: If False, the mean is added back (only the scale is normalised).

    Returns:
        ``[B, T]`` in the dtype of ``values`` (every position, as ``masked_whiten``; multiply by the mask
        to zero the rest).

    Raises:
        ValueError: Fewer than two masked positions over all ranks.
    """
    m = mask.bool()
    x = values.detach().to(torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    local = torch.stack([torch.where(m, x, zero).sum(), m.sum().to(torch.float64)]).cpu()
    total, count = all_reduce(local, group).tolist()
    if count < 2:
        raise ValueError(
            f"whitening needs at least 2 masked-in positions over all DP ranks, got {int(count)}; use a "
            "larger batch"
        )
    mean = total / count
    sq_dev = torch.where(m, (x - mean) ** 2, zero).sum().reshape(1).cpu()
    var = float(all_reduce(sq_dev, group)[0]) / (count - 1)
    whitened = (x - mean) / math.sqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened.to(values.dtype)


def estimator_advantages(estimator: Estimator, token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                         group: dist.ProcessGroup | None = None,
                         **available: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` of ``estimator`` on this rank's samples, for any dp size.

    The estimator gets what its signature takes of ``available`` (:meth:`Estimator.__call__`). One that
    whitens over the batch handed in (:attr:`Estimator.whitens`) has that whitening redone over the whole
    DP batch: its returns (REINFORCE++) or ``returns - values`` (GAE), so the advantages equal the
    estimator's on the concatenation of every rank's batch. Collective over ``group`` for those. An
    estimator that reads group ids needs each prompt's group whole on this rank.

    Args:
        estimator: From :func:`~verl_trainer.core_algos.advantages.resolve_estimator`.
        token_level_rewards: ``[B, T]``.
        response_mask: ``[B, T]``.
        group: The DP group (``None``: the default group, if any).
        **available: ``index`` ``[B]``, ``values`` ``[B, T]``, ``reward_baselines`` ``[B]``, ``gamma``,
            ``lam``, ``config``, ``norm_adv_by_std_in_grpo`` (what the recipe can give).

    Returns:
        ``(advantages, returns)``, ``[B, T]``, 0 outside the mask.
    """
    advantages, returns = estimator(token_level_rewards, response_mask, **available)
    mask = response_mask.to(returns.dtype)
    if estimator.whitens == "returns":
        advantages = global_masked_whiten(returns, response_mask, group) * mask
    elif estimator.whitens == "advantages":
        raw = (returns - available["values"]) * mask
        advantages = global_masked_whiten(raw, response_mask, group) * mask
    return advantages, returns


def keep_all(batch: TensorDict, scores: torch.Tensor, metrics: StepMetrics) -> tuple[TensorDict, bool]:
    """The default selection: every sample trains."""
    return batch, True


class EstimatorAdvantages:
    """A registered advantage estimator on every response token (groups whole on this rank).

    The estimator gets what its signature asks for (``resolve_estimator``): the group ids, the config
    (``gamma``), ``norm_adv_by_std_in_grpo``, ReMax's ``reward_baselines`` when the batch has them. One whose
    advantages are its returns whitened over the batch (REINFORCE++) has its returns whitened over the whole
    DP batch. Logs ``critic/advantages/{mean,min,max}``.

    Args:
        estimator: From :func:`~verl_trainer.core_algos.advantages.resolve_estimator`.
        config: The recipe's config, handed to the estimator (``config=``); ``norm_adv_by_std_in_grpo`` read.
        dp_group: The DP process group (used by a whitening estimator, and passed to one that names a
            ``dp_group`` parameter: it counts over the whole DP batch, as GPG's ``B / M``).
    """

    def __init__(self, estimator: Estimator, config: Any, dp_group: dist.ProcessGroup | None = None) -> None:
        self.estimator = estimator
        self.config = config
        self.dp_group = dp_group
        self._counts_globally = "dp_group" in inspect.signature(estimator.fn).parameters

    def __call__(self, batch: TensorDict, scores: torch.Tensor, metrics: StepMetrics) -> None:
        """Write ``advantages`` and ``returns`` ``[B, T]`` into ``batch``; add the advantages' metrics."""
        mask = batch[schema.RESPONSE_MASK]
        group = self.dp_group if self.estimator.whitens else None  # only a whitening one is a collective
        available = {key: batch[key] for key in (schema.REWARD_BASELINES,) if key in batch.keys()}
        if self._counts_globally:  # one that counts over the whole DP batch (GPG)
            available["dp_group"] = self.dp_group
        adv, returns = estimator_advantages(
            self.estimator, batch[schema.TOKEN_LEVEL_REWARDS], mask, group, index=batch[schema.UID],
            norm_adv_by_std_in_grpo=self.config.norm_adv_by_std_in_grpo, config=self.config, **available)
        batch[schema.ADVANTAGES] = adv
        batch[schema.RETURNS] = returns
        metrics.update(token_stats(adv, mask, "critic/advantages"))


class Advantages:
    """The advantages stage (see the module docstring).

    Args:
        compute: The estimator part.
        select: The selection part (:func:`keep_all` when the recipe selects nothing).
    """

    def __init__(self, compute: ComputePart, select: SelectPart = keep_all) -> None:
        self.compute = compute
        self.select_part = select

    def select(self, batch: TensorDict, scores: torch.Tensor,
               metrics: StepMetrics) -> tuple[TensorDict, bool]:
        """The tensor-only batch to train on and whether any rank has samples left (the selection part's)."""
        return self.select_part(schema.tensor_only(batch), scores, metrics)
