"""GRPO, Dr.GRPO and the DAPO options as modules for ``Trainer.fit``.

GRPO (Shao et al. 2024, arXiv:2402.03300) samples ``rollout.n`` responses per prompt and uses each
response's reward relative to its group (mean-centred, divided by the group std) as the advantage of
every one of its tokens; no critic. Groups stay whole on the rank that generated them until the
advantages are computed (``SequenceBalancing`` may split them afterwards). An optional KL loss to a
frozen reference (``actor.loss.use_kl_loss``) builds a reference engine.

Dr.GRPO (Liu et al. 2025, arXiv:2503.20783) removes GRPO's two length/difficulty biases: no division by
the group std (``norm_adv_by_std_in_grpo=False``) and a sequence loss summed over tokens and divided by a
*constant* (``loss_agg_mode="seq-mean-token-sum-norm"`` with ``loss_scale_factor``, e.g. the maximum
response length) instead of each response's own length. :class:`DrGRPO` checks exactly that.

DAPO (:mod:`verl_trainer.algorithms.dapo`): ``dynamic_sampling`` and ``reward.overlong_buffer`` here;
clip-higher and token-mean in ``actor.loss``.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from verl_trainer.algorithms.config import GRPOConfig
from verl_trainer.algorithms.dapo import dynamic_sampling_filter
from verl_trainer.algorithms.distributed import estimator_advantages
from verl_trainer.algorithms.rl import RLModule
from verl_trainer.core_algos.advantages import resolve_estimator
from verl_trainer.core_algos.aggregation import SEQ_MEAN_TOKEN_SUM_NORM
from verl_trainer.data import schema
from verl_trainer.metrics import token_stats

__all__ = ["GRPO", "DrGRPO"]


class GRPO(RLModule):
    """Group-relative policy optimisation (see the module docstring).

    Args:
        config: See :class:`~verl_trainer.algorithms.config.GRPOConfig`.

    Raises:
        TypeError: ``config`` is not a :class:`GRPOConfig`.
    """

    config: GRPOConfig

    def __init__(self, config: GRPOConfig) -> None:
        if not isinstance(config, GRPOConfig):
            raise TypeError(f"{type(self).__name__} needs a GRPOConfig, got {type(config).__name__}")
        super().__init__(config)
        self.estimator = resolve_estimator(config.adv_estimator)

    def compute_advantages(self, batch: TensorDict, scores: torch.Tensor, metrics: dict[str, Any]) -> None:
        """The configured estimator's advantages on every response token (groups whole on this rank).

        The estimator gets what its signature asks for (``resolve_estimator``): the group ids, the config
        (``gamma``), ``norm_adv_by_std_in_grpo``, ReMax's ``reward_baselines`` (the greedy responses'
        rewards, ``RLModule.score_baseline``). One whose advantages are its returns whitened over the
        batch (REINFORCE++) has its returns whitened over the whole DP batch, so no dp size changes them.
        """
        mask = batch[schema.RESPONSE_MASK]
        group = self._dp_group if self.estimator.whitens else None  # only a whitening one is a collective
        available = {key: batch[key] for key in (schema.REWARD_BASELINES,) if key in batch.keys()}
        adv, returns = estimator_advantages(
            self.estimator, batch[schema.TOKEN_LEVEL_REWARDS], mask, group, index=batch[schema.UID],
            norm_adv_by_std_in_grpo=self.config.norm_adv_by_std_in_grpo, config=self.config, **available)
        batch[schema.ADVANTAGES] = adv
        batch[schema.RETURNS] = returns
        metrics.update(token_stats(adv, mask, "critic/advantages"))

    def select_samples(self, batch: TensorDict, scores: torch.Tensor,
                       metrics: dict[str, Any]) -> tuple[TensorDict, bool]:
        """DAPO dynamic sampling when enabled: drop groups with equal rewards, ranks kept in step."""
        if not self.config.dynamic_sampling:
            return batch, True
        kept, any_left, dapo_metrics = dynamic_sampling_filter(
            batch, scores, self._dp_group, self._dp_size
        )
        metrics.update(dapo_metrics)
        return kept, any_left


class DrGRPO(GRPO):
    """GRPO Done Right: GRPO whose config must be Dr.GRPO's (see the module docstring).

    Args:
        config: A :class:`GRPOConfig` with ``norm_adv_by_std_in_grpo=False`` and
            ``actor.loss.loss_agg_mode="seq-mean-token-sum-norm"`` with a constant ``loss_scale_factor``
            (``configs/dr_grpo.yaml``).

    Raises:
        ValueError: The config is not Dr.GRPO's; the message says what to set.
    """

    def __init__(self, config: GRPOConfig) -> None:
        problems = []
        if isinstance(config, GRPOConfig):
            if config.norm_adv_by_std_in_grpo:
                problems.append("algorithm.norm_adv_by_std_in_grpo=false")
            loss = config.actor.loss
            if loss.loss_agg_mode != SEQ_MEAN_TOKEN_SUM_NORM or loss.loss_scale_factor is None:
                problems.append(
                    f"algorithm.actor.loss.loss_agg_mode={SEQ_MEAN_TOKEN_SUM_NORM} with a constant "
                    f"algorithm.actor.loss.loss_scale_factor (e.g. rollout.max_new_tokens="
                    f"{config.rollout.max_new_tokens})"
                )
        if problems:
            raise ValueError("Dr.GRPO needs " + " and ".join(problems) + "; configs/dr_grpo.yaml sets both")
        super().__init__(config)
