"""PPO with a critic: actor + critic (+ reference), GAE, critic warm-up, clipped value loss.

Per step, after the rollout and rewards (:class:`~verl_trainer.algorithms.rl.RLModule`), as the advantage
and update stages' parts (:mod:`verl_trainer.algorithms.critic`):

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
from verl_trainer.algorithms.critic import CriticAdvantages, CriticUpdates, CriticWarmup, KLInReward
from verl_trainer.algorithms.rl import ActorDueOverride, RLModule
from verl_trainer.algorithms.stages.signal import ComputePart, SelectPart, estimator_advantages, keep_all
from verl_trainer.algorithms.stages.update import ActorDuePart, CriticPart
from verl_trainer.core_algos.advantages import AdvantageEstimator, resolve_estimator
from verl_trainer.core_algos.losses import value_loss
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

    def advantage_parts(self) -> tuple[ComputePart, SelectPart]:
        """The critic's values, then ``adv_estimator``: :class:`.critic.CriticAdvantages`.

        A subclass's :meth:`compute_advantages` / :meth:`select_samples` override is plugged instead.
        """
        compute = (self.compute_advantages if self.overridden("compute_advantages", PPO)
                   else self._critic_advantages())
        return compute, self.select_samples if self.overridden("select_samples", RLModule) else keep_all

    def update_parts(self) -> tuple[ActorDuePart | None, CriticPart | None]:
        """The critic warm-up and the critic's updates (:mod:`verl_trainer.algorithms.critic`).

        A subclass's :meth:`actor_update_due` / :meth:`update_critic` override is plugged instead.
        """
        due = (ActorDueOverride(self.actor_update_due) if self.overridden("actor_update_due", PPO)
               else CriticWarmup(self.config.critic.warmup_steps))
        critic = self.update_critic if self.overridden("update_critic", PPO) else self._critic_updates()
        return due, critic

    def _critic_advantages(self) -> CriticAdvantages:
        cfg = self.config
        kl = KLInReward(self.engines, cfg, self.uses_reference) if cfg.use_kl_in_reward else None
        return CriticAdvantages(self.engines["critic"], self.estimator, cfg, self._dp_group, kl)

    def _critic_updates(self) -> CriticUpdates:
        hooks = self.trainer.step_hooks if self.trainer is not None else None
        return CriticUpdates(self.engines["critic"], self.critic_loss, self.config.actor.ppo_epochs, hooks)

    def compute_advantages(self, batch: TensorDict, scores: torch.Tensor, metrics: dict[str, Any]) -> None:
        """Critic values, then ``adv_estimator`` (GAE: whitened over the global batch).

        Sets ``values``, ``advantages``, ``returns``: :class:`.critic.CriticAdvantages`.
        """
        self._critic_advantages()(batch, scores, metrics)

    def apply_kl_in_reward(self, batch: TensorDict, metrics: dict[str, Any]) -> None:
        """``token_level_rewards = token_level_scores - kl_coef * KL(old || ref)`` on the response tokens.

        Computes ``old_log_probs`` and ``ref_log_prob`` here (the step then reuses them):
        :class:`~verl_trainer.algorithms.critic.KLInReward`.
        """
        KLInReward(self.engines, self.config, self.uses_reference)(batch, metrics)

    def actor_update_due(self) -> bool:
        """Not during the first ``critic.warmup_steps`` trainer steps."""
        return CriticWarmup(self.config.critic.warmup_steps)(self.trainer.global_step)

    def update_critic(self, mini_batches: list[TensorDict]) -> dict[str, Any]:
        """``actor.ppo_epochs`` passes of clipped value-loss updates over the mini-batches."""
        return self._critic_updates()(mini_batches)
