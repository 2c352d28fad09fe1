"""PPO with a critic: actor + critic (+ reference), GAE, critic warm-up, clipped value loss.

Per step, after the rollout and rewards (:class:`~verl_trainer.algorithms.rl.RLModule`), as the advantage
and update stages' parts:

1. optionally (``use_kl_in_reward``) the rewards get ``- kl_coef * KL(pi_old || pi_ref)`` per token;
   the critic engine computes ``values`` ``[B, T]`` (``values[:, t]``: the state before token ``t``);
2. ``adv_estimator`` (``gae``, or any registered estimator that reads the critic's ``values``) over the
   response tokens: GAE gives ``returns = A + V`` and raw advantages, which are **whitened with the mean
   and variance of the whole step batch over all DP ranks** (:func:`compute_gae_advantages`,
   :func:`~verl_trainer.algorithms.stages.signal.estimator_advantages`), so they do not depend on the dp
   size (verl whitens on its driver, which holds the whole batch);
3. per mini-batch (``ppo_epochs`` passes): the critic is updated with the clipped value loss
   (``critic.loss.cliprange_value``), then the actor with the PPO loss — except during the first
   ``critic.warmup_steps`` trainer steps, when only the critic trains.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_trainer.algorithms.config import PPOConfig
from verl_trainer.algorithms.rl import RLModule
from verl_trainer.algorithms.stages.signal import estimator_advantages
from verl_trainer.core_algos import kl_penalty
from verl_trainer.core_algos.advantages import AdvantageEstimator, resolve_estimator
from verl_trainer.core_algos.losses import value_loss
from verl_trainer.data import schema
from verl_trainer.metrics import Metric, token_stats
from verl_trainer.module import EngineSpec

__all__ = ["PPO", "compute_gae_advantages"]


def compute_gae_advantages(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages whitened over the whole DP batch, and the returns.

    The registry's ``gae`` (verl's recursion) gives ``returns = A_raw + V``; the raw advantages
    ``returns - V`` are then whitened with :func:`global_masked_whiten` over ``group`` — the same numbers
    as ``gae`` on the concatenation of every rank's batch, for any dp size. Collective over ``group``.

    Args:
        token_level_rewards: ``[B, T]`` (the outcome reward on each response's last token).
        values: ``[B, T]`` critic values aligned with ``input_ids``.
        response_mask: ``[B, T]``.
        gamma: Discount factor.
        lam: GAE lambda.
        group: The DP group (``None``: the default group, if any).

    Returns:
        ``(advantages, returns)``, ``[B, T]``, 0 outside the mask.
    """
    return estimator_advantages(resolve_estimator(AdvantageEstimator.GAE), token_level_rewards,
                                response_mask, group, values=values, gamma=gamma, lam=lam)


class PPO(RLModule):
    """Proximal policy optimisation with a learned critic (see the module docstring).

    Args:
        config: See :class:`~verl_trainer.algorithms.config.PPOConfig`.

    Raises:
        TypeError: ``config`` is not a :class:`PPOConfig`.
    """

    config: PPOConfig

    def __init__(self, config: PPOConfig) -> None:
        if not isinstance(config, PPOConfig):
            raise TypeError(f"PPO needs a PPOConfig, got {type(config).__name__}")
        super().__init__(config)
        self.critic_loss = value_loss(config.critic.loss)
        self.estimator = resolve_estimator(config.adv_estimator)

    @property
    def uses_reference(self) -> bool:
        """A reference engine for the KL loss or the KL in the reward."""
        return self.config.actor.loss.use_kl_loss or self.config.use_kl_in_reward

    def extra_engines(self) -> dict[str, EngineSpec]:
        """The critic: a value model whose backbone starts from the policy's checkpoint."""
        critic = self.config.critic
        engine = critic.engine.replace(model_path=critic.engine.model_path or self.config.model_path)
        return {"critic": EngineSpec("value_model", engine, critic.optim)}

    def compute_advantages(self, batch: TensorDict, scores: torch.Tensor, metrics: dict[str, Any]) -> None:
        """Critic values, then ``adv_estimator`` (GAE: whitened over the global batch).

        Sets ``values``, ``advantages``, ``returns``.
        """
        critic = self.engines["critic"]
        mask = batch[schema.RESPONSE_MASK]
        if self.config.use_kl_in_reward:
            self.apply_kl_in_reward(batch, metrics)
        with critic.eval_mode():
            values = critic.infer_batch(schema.tensor_only(batch))["model_output"]["values"]
        values = values * mask.to(values.dtype)
        advantages, returns = estimator_advantages(
            self.estimator, batch[schema.TOKEN_LEVEL_REWARDS], mask, self._dp_group, values=values,
            index=batch[schema.UID], gamma=self.config.gamma, lam=self.config.lam, config=self.config)
        batch[schema.VALUES] = values
        batch[schema.ADVANTAGES] = advantages
        batch[schema.RETURNS] = returns
        metrics.update(token_stats(advantages, mask, "critic/advantages"))
        metrics.update(token_stats(returns, mask, "critic/returns"))
        metrics.update(token_stats(values, mask, "critic/values"))

    def apply_kl_in_reward(self, batch: TensorDict, metrics: dict[str, Any]) -> None:
        """``token_level_rewards = token_level_scores - kl_coef * KL(old || ref)`` on the response tokens.

        Computes ``old_log_probs`` and ``ref_log_prob`` here (the step then reuses them).
        """
        data = schema.tensor_only(batch)
        self.compute_log_probs(data)
        batch[schema.OLD_LOG_PROBS] = data[schema.OLD_LOG_PROBS]
        batch[schema.REF_LOG_PROB] = data[schema.REF_LOG_PROB]
        mask = batch[schema.RESPONSE_MASK]
        kld = kl_penalty(data[schema.OLD_LOG_PROBS], data[schema.REF_LOG_PROB], self.config.kl_penalty) * mask
        batch[schema.TOKEN_LEVEL_REWARDS] = batch[schema.TOKEN_LEVEL_SCORES] - self.config.kl_coef * kld
        metrics["actor/reward_kl_penalty"] = Metric.token_mean(kld, mask)
        metrics["actor/reward_kl_penalty_coeff"] = Metric.mean(self.config.kl_coef)

    def actor_update_due(self) -> bool:
        """Not during the first ``critic.warmup_steps`` trainer steps."""
        return self.trainer.global_step >= self.config.critic.warmup_steps

    def update_critic(self, mini_batches: list[TensorDict]) -> dict[str, Any]:
        """``actor.ppo_epochs`` passes of clipped value-loss updates over the mini-batches."""
        return self.run_updates("critic", self.critic_loss, mini_batches, self.config.actor.ppo_epochs)
