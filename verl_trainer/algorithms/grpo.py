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
from verl_trainer.algorithms.dapo import DynamicSampling
from verl_trainer.algorithms.rl import RLModule
from verl_trainer.algorithms.stages.signal import ComputePart, EstimatorAdvantages, SelectPart, keep_all
from verl_trainer.core_algos.advantages import resolve_estimator
from verl_trainer.core_algos.aggregation import SEQ_MEAN_TOKEN_SUM_NORM

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

    def advantage_parts(self) -> tuple[ComputePart, SelectPart]:
        """The configured estimator and, with ``dynamic_sampling``, DAPO's selection.

        :class:`EstimatorAdvantages` and :class:`~verl_trainer.algorithms.dapo.DynamicSampling`; a
        subclass's :meth:`compute_advantages` / :meth:`select_samples` override is plugged instead.
        """
        compute = (self.compute_advantages if self.overridden("compute_advantages", GRPO)
                   else EstimatorAdvantages(self.estimator, self.config, self._dp_group))
        dapo = self.config.dynamic_sampling
        selection = DynamicSampling(self._dp_group, self._dp_size) if dapo else keep_all
        return compute, self.select_samples if self.overridden("select_samples", GRPO) else selection

    def compute_advantages(self, batch: TensorDict, scores: torch.Tensor, metrics: dict[str, Any]) -> None:
        """The configured estimator's advantages on every response token (:class:`EstimatorAdvantages`)."""
        EstimatorAdvantages(self.estimator, self.config, self._dp_group)(batch, scores, metrics)

    def select_samples(self, batch: TensorDict, scores: torch.Tensor,
                       metrics: dict[str, Any]) -> tuple[TensorDict, bool]:
        """DAPO dynamic sampling when enabled: drop groups with equal rewards, ranks kept in step."""
        if not self.config.dynamic_sampling:
            return batch, True
        return DynamicSampling(self._dp_group, self._dp_size)(batch, scores, metrics)


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
