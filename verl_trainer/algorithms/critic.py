"""PPO's critic as parts of the RL step's stages, each holding only what it uses (never the module).

* :class:`KLInReward` and :class:`CriticAdvantages`: the advantages stage's estimator part (the critic's
  values, then ``adv_estimator`` over them; optionally the KL penalty in the rewards first);
* :class:`CriticUpdates`: the updater's critic part (clipped value-loss updates over the mini-batches);
* :class:`CriticWarmup`: the updater's actor-due part (no actor update in the first ``warmup_steps``).

:class:`~verl_trainer.algorithms.PPO` plugs them in (``advantage_parts``, ``update_parts``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_trainer.algorithms.config import PPOConfig
from verl_trainer.algorithms.stages import StepMetrics
from verl_trainer.algorithms.stages.signal import estimator_advantages
from verl_trainer.algorithms.stages.update import compute_log_probs, run_updates
from verl_trainer.core_algos import kl_penalty
from verl_trainer.core_algos.advantages import Estimator
from verl_trainer.data import schema
from verl_trainer.engine.base import BaseEngine
from verl_trainer.metrics import Metric, token_stats

__all__ = ["CriticAdvantages", "CriticUpdates", "CriticWarmup", "KLInReward"]


class KLInReward:
    """``token_level_rewards = token_level_scores - kl_coef * KL(old || ref)`` on the response tokens.

    Computes ``old_log_probs`` and ``ref_log_prob`` into the batch (the updater then reuses them). Logs
    ``actor/reward_kl_penalty`` (token mean) and ``actor/reward_kl_penalty_coeff``.

    Args:
        engines: The module's engines (``actor``; ``ref`` unless ``ref_in_actor``).
        config: The PPO config (``kl_coef``, ``kl_penalty``, ``ref_in_actor``).
        reference: Whether the reference's log-probs are computed (the module's ``uses_reference``).
    """

    def __init__(self, engines: Mapping[str, BaseEngine], config: PPOConfig, reference: bool) -> None:
        self.engines = engines
        self.config = config
        self.reference = reference

    def __call__(self, batch: TensorDict, metrics: StepMetrics) -> None:
        """Rewrite ``batch``'s ``token_level_rewards``; add the penalty's metrics."""
        data = schema.tensor_only(batch)
        compute_log_probs(self.engines, data, True, self.reference, self.config.ref_in_actor)
        batch[schema.OLD_LOG_PROBS] = data[schema.OLD_LOG_PROBS]
        batch[schema.REF_LOG_PROB] = data[schema.REF_LOG_PROB]
        mask = batch[schema.RESPONSE_MASK]
        kld = kl_penalty(data[schema.OLD_LOG_PROBS], data[schema.REF_LOG_PROB], self.config.kl_penalty) * mask
        batch[schema.TOKEN_LEVEL_REWARDS] = batch[schema.TOKEN_LEVEL_SCORES] - self.config.kl_coef * kld
        metrics["actor/reward_kl_penalty"] = Metric.token_mean(kld, mask)
        metrics["actor/reward_kl_penalty_coeff"] = Metric.mean(self.config.kl_coef)


class CriticAdvantages:
    """The advantages stage's estimator part with a critic: values, then ``adv_estimator`` over them.

    Sets ``values`` (0 outside the response mask), ``advantages`` and ``returns`` ``[B, T]``; a whitening
    estimator (GAE) is whitened over the whole DP batch
    (:func:`~verl_trainer.algorithms.stages.signal.estimator_advantages`), a collective over ``dp_group``.
    Logs ``critic/{advantages,returns,values}/{mean,min,max}``.

    Args:
        critic: The critic engine (a value model).
        estimator: From :func:`~verl_trainer.core_algos.advantages.resolve_estimator`.
        config: The PPO config (``gamma``, ``lam``; handed to the estimator as ``config=``).
        dp_group: The DP process group.
        kl_in_reward: Run first when the rewards carry the KL penalty (``use_kl_in_reward``); else ``None``.
    """

    def __init__(self, critic: BaseEngine, estimator: Estimator, config: PPOConfig,
                 dp_group: dist.ProcessGroup | None = None, kl_in_reward: KLInReward | None = None) -> None:
        self.critic = critic
        self.estimator = estimator
        self.config = config
        self.dp_group = dp_group
        self.kl_in_reward = kl_in_reward

    def __call__(self, batch: TensorDict, scores: torch.Tensor, metrics: StepMetrics) -> None:
        """Write ``values``, ``advantages``, ``returns`` into ``batch``; add their metrics."""
        mask = batch[schema.RESPONSE_MASK]
        if self.kl_in_reward is not None:
            self.kl_in_reward(batch, metrics)
        with self.critic.eval_mode():
            values = self.critic.infer_batch(schema.tensor_only(batch))["model_output"]["values"]
        values = values * mask.to(values.dtype)
        advantages, returns = estimator_advantages(
            self.estimator, batch[schema.TOKEN_LEVEL_REWARDS], mask, self.dp_group, values=values,
            index=batch[schema.UID], gamma=self.config.gamma, lam=self.config.lam, config=self.config)
        batch[schema.VALUES] = values
        batch[schema.ADVANTAGES] = advantages
        batch[schema.RETURNS] = returns
        metrics.update(token_stats(advantages, mask, "critic/advantages"))
        metrics.update(token_stats(returns, mask, "critic/returns"))
        metrics.update(token_stats(values, mask, "critic/values"))


class CriticUpdates:
    """The updater's critic part: ``epochs`` passes of value-loss updates over the step's mini-batches.

    Args:
        critic: The critic engine.
        loss_fn: The value loss (:func:`~verl_trainer.core_algos.losses.value_loss`).
        epochs: Passes over the mini-batches (``actor.ppo_epochs``: the critic shares the actor's).
        hooks: The trainer's step hooks, passed to ``engine.train_batch`` (``None``: none).
    """

    def __init__(self, critic: BaseEngine, loss_fn: Callable[..., Any], epochs: int,
                 hooks: Any = None) -> None:
        self.critic = critic
        self.loss_fn = loss_fn
        self.epochs = epochs
        self.hooks = hooks

    def __call__(self, mini_batches: list[TensorDict]) -> dict[str, Any]:
        """The critic's step outputs (``critic_micro_batches``, ``critic/grad_norm``...: ``run_updates``)."""
        return run_updates(self.critic, "critic", self.loss_fn, mini_batches, self.epochs, self.hooks)


class CriticWarmup:
    """The updater's actor-due part: the actor trains from trainer step ``warmup_steps`` on (0-based).

    Args:
        warmup_steps: ``critic.warmup_steps`` (0: the actor trains every step).
    """

    def __init__(self, warmup_steps: int) -> None:
        self.warmup_steps = warmup_steps

    def __call__(self, step: int) -> bool:
        """Whether the actor trains at ``step`` (the trainer's ``global_step`` before the step)."""
        return step >= self.warmup_steps
