"""Typed config of on-policy distillation (``algorithm.distill``), validated when it is built.

::

    algorithm:
      distill:
        teacher: {model_path: path/to/teacher, engine: {micro_batch_size_per_gpu: 64}}
        mode: reward            # reward: -coef * KL per token into the rewards | loss: + coef * KL loss term
        kl_estimator: k1        # k1 | k2 | k3 (core_algos/distill.py)
        coef: 1.0
        top_k: 0                # > 0: also the top-k forward KL loss term KL(teacher || student)
        top_k_coef: 1.0
        top_k_normalization: renorm   # renorm | tail
        reward_weight: 1.0      # weight of the verifiable reward (algorithm.reward); 0: distillation alone

Names: ``coef`` is TRL's GKD ``beta``-free weight and verl's ``kl_coef`` of a KL term; ``teacher.model_path``
mirrors TRL's ``teacher_model_name_or_path`` and verl's ``actor_rollout_ref.model.path``; ``top_k`` is the
number of teacher log-probs per position (vLLM's ``logprobs``, verl's distillation ``topk``). See
``docs/distillation.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from verl_trainer.algorithms.config import GRPOConfig
from verl_trainer.core_algos.distill import KL_ESTIMATORS, TOPK_NORMALIZATIONS, DistillLossConfig
from verl_trainer.core_algos.losses import PPOLossConfig
from verl_trainer.engine.config import EngineConfig

__all__ = ["DISTILL_MODES", "DistillConfig", "DistillGRPOConfig", "TeacherConfig"]

DISTILL_MODES = ("reward", "loss")
"""How the reverse KL to the teacher enters: a dense per-token reward, or a term of the actor loss."""


@dataclass
class TeacherConfig:
    """The frozen teacher: an inference-only engine sharded like the reference.

    Attributes:
        model_path: Its HF directory (or cached hub id); its tokenizer must equal the student's.
        engine: Micro-batching (``micro_batch_size_per_gpu``, ``use_dynamic_bsz``,
            ``max_token_len_per_gpu``), ``param_offload``, ``model_dtype``; ``model_path`` and
            ``temperature`` (the rollout's) are filled in.
    """

    model_path: str = ""
    engine: EngineConfig = field(default_factory=EngineConfig)


@dataclass
class DistillConfig:
    """``algorithm.distill``: what the student learns from the teacher (module docstring).

    Attributes:
        teacher: The teacher model and its engine.
        mode: ``reward``: each response token's reward gets ``-coef * estimator`` (a dense reward for the
            advantage estimator); ``loss``: the actor loss gets ``+ coef * agg(estimator)``.
        kl_estimator: ``k1``, ``k2`` or ``k3`` of ``KL(student || teacher)`` per sampled token. As a reward
            ``k1`` is the standard (its policy gradient is the reverse KL's); as a loss ``k2`` has the reverse
            KL's expected gradient, ``k3`` the forward KL's and ``k1`` none (docs/distillation.md).
        coef: Weight of the reverse-KL reward or loss term (0: none; then ``top_k`` must be set).
        top_k: Teacher log-probs per position for the top-k forward KL loss term ``KL(teacher || student)``;
            0: off.
        top_k_coef: Weight of the top-k term.
        top_k_normalization: ``renorm`` (both distributions renormalised over the teacher's top-k) or
            ``tail`` (the top-k plus one bucket for the rest of the vocabulary).
        reward_weight: Weight of the verifiable reward (``algorithm.reward``) in the rewards the advantages
            are computed from; 0: distillation alone.
    """

    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    mode: str = "reward"
    kl_estimator: str = "k1"
    coef: float = 1.0
    top_k: int = 0
    top_k_coef: float = 1.0
    top_k_normalization: str = "renorm"
    reward_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in DISTILL_MODES:
            raise ValueError(f"algorithm.distill.mode={self.mode!r}; choose one of "
                             f"{', '.join(DISTILL_MODES)} (reward: -coef * KL per token in the rewards; "
                             "loss: a KL term in the actor loss)")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"algorithm.distill.kl_estimator={self.kl_estimator!r}; choose one of "
                             f"{', '.join(KL_ESTIMATORS)}")
        if self.top_k_normalization not in TOPK_NORMALIZATIONS:
            raise ValueError(f"algorithm.distill.top_k_normalization={self.top_k_normalization!r}; choose "
                             f"one of {', '.join(TOPK_NORMALIZATIONS)}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"algorithm.distill.top_k={self.top_k!r} must be an int >= 0 (0: no top-k term)")
        for name in ("coef", "top_k_coef", "reward_weight"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"algorithm.distill.{name}={value!r} must be a finite number >= 0")
        if self.coef == 0 and not (self.top_k and self.top_k_coef):
            raise ValueError("algorithm.distill.coef=0 and no top-k term: nothing is learned from the "
                             "teacher; set algorithm.distill.coef > 0, or top_k > 0 with top_k_coef > 0")

    def loss_terms(self, actor_loss: PPOLossConfig) -> DistillLossConfig | None:
        """The actor loss's distillation terms (aggregated like the actor loss); ``None``: none."""
        kl_coef = self.coef if self.mode == "loss" else 0.0
        top_k_coef = self.top_k_coef if self.top_k else 0.0
        if not kl_coef and not top_k_coef:
            return None
        return DistillLossConfig(kl_coef=kl_coef, kl_estimator=self.kl_estimator, top_k_coef=top_k_coef,
                                 top_k_normalization=self.top_k_normalization,
                                 loss_agg_mode=actor_loss.loss_agg_mode,
                                 loss_scale_factor=actor_loss.loss_scale_factor)


def _parallel_sizes(engine: EngineConfig) -> dict[str, int]:
    sizes = {"ulysses_sequence_parallel_size": engine.ulysses_sequence_parallel_size,
             "tensor_model_parallel_size": engine.tensor_model_parallel_size,
             "pipeline_model_parallel_size": engine.pipeline_model_parallel_size}
    return {name: size for name, size in sizes.items() if size > 1}


@dataclass
class DistillGRPOConfig(GRPOConfig):
    """GRPO (any estimator it takes) with a teacher: :class:`~verl_trainer.algorithms.distill.DistillGRPO`.

    Attributes:
        distill: The teacher and how the student learns from it.
    """

    distill: DistillConfig = field(default_factory=DistillConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.distill.top_k:
            engines = (("actor", self.actor.engine), ("distill.teacher", self.distill.teacher.engine))
            for who, engine in engines:
                if layouts := _parallel_sizes(engine):
                    shown = ", ".join(f"algorithm.{who}.engine.{k}={v}" for k, v in layouts.items())
                    raise ValueError(
                        f"algorithm.distill.top_k={self.distill.top_k} needs the whole vocabulary and "
                        f"sequence on one rank, but {shown}; set them to 1 (dp only), or "
                        "algorithm.distill.top_k=0 (the reverse-KL terms run on every layout)")
