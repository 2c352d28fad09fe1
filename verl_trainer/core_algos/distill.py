"""On-policy distillation toward a frozen teacher: per-token KL estimates and the loss terms built on them.

The student ``pi_s`` samples the responses; the teacher ``pi_t`` scores the same tokens
(Agarwal et al. 2024, "On-Policy Distillation of Language Models", arXiv:2306.13649 — TRL's GKD;
Gu et al. 2024, MiniLLM, arXiv:2306.08543). Per sampled token ``x`` with ``s = log pi_s(x)``,
``t = log pi_t(x)`` (:func:`reverse_kl`, the estimators of Schulman 2020, "Approximating KL divergence"):

* ``k1 = s - t``; its expectation under ``pi_s`` is ``KL(pi_s || pi_t)``, the reverse KL. As a reward
  (``-k1`` per token, fed to the advantage estimator) its policy gradient is the reverse KL's gradient.
  As a loss its gradient is ``grad s``, whose expectation under ``pi_s`` is 0: it does not move the
  expected reverse KL (documented in ``docs/distillation.md``; use it as a reward, or ``k2`` as a loss).
* ``k2 = (s - t)^2 / 2``; as a loss its gradient ``(s - t) grad s`` has the reverse KL's gradient as
  expectation.
* ``k3 = r - log r - 1`` with ``r = exp(t - s)``; expectation the reverse KL, never negative. Not clamped
  at 10 as verl's ``low_var_kl`` is (a student's log-ratio to a teacher passes 10 routinely; the clamp
  would cut the signal of the worst tokens); only ``log r <= 20`` (:data:`K3_MAX_LOG_RATIO`). As a loss
  its gradient ``(1 - r) grad s`` has expectation ``grad KL(pi_t || pi_s)``
  (the forward KL's).

Top-k forward KL (:func:`topk_forward_kl`): from the teacher's ``k`` most likely ids per position with
their log-probs ``t_1..t_k`` and the student's log-probs ``s_1..s_k`` of the same ids, either

* ``renorm``: both renormalised over the ``k`` ids, ``p_i = softmax(t)_i``, ``q_i = softmax(s)_i``, and
  ``sum_i p_i (log p_i - log q_i)`` — the KL of the two distributions restricted to the teacher's top-k
  (0 when the student matches the teacher's shape there, whatever mass it puts elsewhere); or
* ``tail``: the ``k`` ids plus one bucket for the rest of the vocabulary, ``P_tail = 1 - sum exp(t)``,
  ``Q_tail = 1 - sum exp(s)``: ``sum_i e^{t_i} (t_i - s_i) + P_tail (log P_tail - log Q_tail)``, the KL of the
  two coarsened distributions — never more than the full ``KL(pi_t || pi_s)`` (data processing) and equal to
  it at ``k = V``.

Both equal the full forward KL when ``k`` is the vocabulary size. :class:`DistillLoss` aggregates every
term with :func:`~verl_trainer.core_algos.aggregation.agg_loss` and the step's global denominators, so the
loss, its gradient and its metrics do not depend on dp size or micro-batching (verl issue #7200 was a
distillation loss averaged per micro-batch).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from verl_trainer.core_algos.aggregation import (
    AGG_MODES,
    TOKEN_MEAN,
    GlobalBatchInfo,
    agg_loss,
    global_batch_kwargs,
)
from verl_trainer.data.schema import LOSS_MASK, TEACHER_LOG_PROBS, TEACHER_TOPK_LOG_PROBS
from verl_trainer.metrics import Metric

if TYPE_CHECKING:
    from tensordict import TensorDict

__all__ = [
    "KL_ESTIMATORS",
    "TOPK_NORMALIZATIONS",
    "DistillLoss",
    "DistillLossConfig",
    "reverse_kl",
    "topk_forward_kl",
]

KL_ESTIMATORS = ("k1", "k2", "k3")
"""Per-token estimators of ``KL(pi_s || pi_t)`` from the sampled token's two log-probs."""
K3_MAX_LOG_RATIO = 20.0
"""``k3`` reads ``log r = t - s`` clamped to at most this (``e^20 ~ 5e8``: finite in float32)."""
TOPK_NORMALIZATIONS = ("renorm", "tail")
"""How :func:`topk_forward_kl` treats the mass outside the teacher's top-k (module docstring)."""

LossFn = Callable[..., "tuple[torch.Tensor, dict[str, Metric]]"]


def reverse_kl(student_log_prob: torch.Tensor, teacher_log_prob: torch.Tensor,
               estimator: str) -> torch.Tensor:
    """Per-token estimate of ``KL(pi_s || pi_t)`` at the sampled tokens (module docstring).

    Args:
        student_log_prob: ``[b, t]`` log-probs of the sampled tokens under the student.
        teacher_log_prob: ``[b, t]`` the same under the teacher.
        estimator: ``k1``, ``k2`` or ``k3``.

    Returns:
        ``[b, t]``.

    Raises:
        ValueError: Unknown estimator.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator={estimator!r} is not one of {KL_ESTIMATORS}")
    diff = student_log_prob - teacher_log_prob
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff.square()
    log_r = (-diff).clamp(max=K3_MAX_LOG_RATIO)
    return torch.expm1(log_r) - log_r


def topk_forward_kl(teacher_topk_log_probs: torch.Tensor, student_topk_log_probs: torch.Tensor,
                    normalization: str = "renorm", eps: float = 1e-6) -> torch.Tensor:
    """Per-position ``KL(pi_t || pi_s)`` over the teacher's top-k ids (module docstring).

    Args:
        teacher_topk_log_probs: ``[b, t, k]`` the teacher's log-probs of its top-k ids.
        student_topk_log_probs: ``[b, t, k]`` the student's log-probs of the same ids.
        normalization: ``renorm`` or ``tail``.
        eps: ``tail``: the rest's probability is clamped to at least ``eps`` (a top-k holding all the
            mass in float32).

    Returns:
        ``[b, t]``, float32 (float64 for float64 inputs).

    Raises:
        ValueError: Unknown normalization, or the two shapes differ.
    """
    if normalization not in TOPK_NORMALIZATIONS:
        raise ValueError(f"top_k_normalization={normalization!r} is not one of {TOPK_NORMALIZATIONS}")
    if teacher_topk_log_probs.shape != student_topk_log_probs.shape:
        raise ValueError(f"teacher top-k log-probs {tuple(teacher_topk_log_probs.shape)} and student "
                         f"{tuple(student_topk_log_probs.shape)} differ")
    dtype = torch.promote_types(teacher_topk_log_probs.dtype, torch.float32)  # float32 at least
    t = teacher_topk_log_probs.to(dtype)
    s = student_topk_log_probs.to(dtype)
    if normalization == "renorm":
        log_p = t - torch.logsumexp(t, -1, keepdim=True)
        log_q = s - torch.logsumexp(s, -1, keepdim=True)
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    head = (t.exp() * (t - s)).sum(-1)
    p_tail = (1 - t.exp().sum(-1)).clamp_min(eps)
    q_tail = (1 - s.exp().sum(-1)).clamp_min(eps)
    return head + p_tail * (p_tail.log() - q_tail.log())


@dataclass(frozen=True)
class DistillLossConfig:
    """The distillation terms of the actor loss.

    Attributes:
        kl_coef: Weight of the reverse-KL term ``agg(estimator(s, t))``; 0: no such term.
        kl_estimator: ``k1``, ``k2`` or ``k3`` (:func:`reverse_kl`).
        top_k_coef: Weight of the top-k forward-KL term; 0: none (then the batch needs no top-k fields).
        top_k_normalization: ``renorm`` or ``tail`` (:func:`topk_forward_kl`).
        loss_agg_mode: See :func:`~verl_trainer.core_algos.agg_loss`.
        loss_scale_factor: The constant of ``seq-mean-token-sum-norm``.
    """

    kl_coef: float = 1.0
    kl_estimator: str = "k3"
    top_k_coef: float = 0.0
    top_k_normalization: str = "renorm"
    loss_agg_mode: str = TOKEN_MEAN
    loss_scale_factor: float | None = None

    def __post_init__(self) -> None:
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"DistillLossConfig.kl_estimator={self.kl_estimator!r}; choose one of "
                             f"{', '.join(KL_ESTIMATORS)}")
        if self.top_k_normalization not in TOPK_NORMALIZATIONS:
            raise ValueError(f"DistillLossConfig.top_k_normalization={self.top_k_normalization!r}; choose "
                             f"one of {', '.join(TOPK_NORMALIZATIONS)}")
        if self.loss_agg_mode not in AGG_MODES:
            raise ValueError(f"DistillLossConfig.loss_agg_mode={self.loss_agg_mode!r}; choose one of "
                             f"{', '.join(AGG_MODES)}")
        for name in ("kl_coef", "top_k_coef"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"DistillLossConfig.{name}={getattr(self, name)!r} must be >= 0")
        if self.kl_coef == 0 and self.top_k_coef == 0:
            raise ValueError("DistillLossConfig: kl_coef and top_k_coef are both 0, so the loss has no "
                             "distillation term; set one > 0")


def _get(source: Any, key: str, who: str) -> torch.Tensor:
    if key not in source.keys():
        raise KeyError(f"{who} needs {key!r}; present: {sorted(str(k) for k in source.keys())}")
    return source[key]


class DistillLoss:
    """The distillation loss terms, alone or added to a base actor loss (``base``).

    ``loss = base + kl_coef * agg(reverse_kl(log_probs, teacher_log_probs))
    + top_k_coef * agg(topk_forward_kl(teacher_topk_log_probs, gathered_log_probs))`` over ``loss_mask``,
    each term with the step's global denominators. Reads ``model_output["log_probs"]`` ``[b, t]`` and,
    with the top-k term, ``model_output["gathered_log_probs"]`` ``[b, t, k]`` (the engine computes it when
    the batch holds ``teacher_topk_ids``); ``micro_batch``: ``loss_mask``, ``teacher_log_probs``, and
    ``teacher_topk_log_probs``. Metrics (``SUM``, partial values): ``actor/distill_kl_loss``,
    ``actor/distill_topk_kl_loss``; token means: ``actor/distill_kl`` (the estimator's value).

    Args:
        config: The terms' settings.
        base: The actor loss the terms are added to (``None``: the terms alone).
    """

    def __init__(self, config: DistillLossConfig, base: LossFn | None = None) -> None:
        self.config = config
        self.base = base

    def __call__(self, model_output: Mapping[str, torch.Tensor],
                 data: TensorDict | Mapping[str, torch.Tensor],
                 info: GlobalBatchInfo | None = None) -> tuple[torch.Tensor, dict[str, Metric]]:
        """Partial loss and metrics of one micro-batch (``core_algos/losses.py``'s contract)."""
        cfg = self.config
        info = GlobalBatchInfo.from_batch(data) if info is None else info
        loss, metrics = self.base(model_output, data, info) if self.base is not None else (None, {})
        metrics = dict(metrics)
        mask = _get(data, LOSS_MASK, "distill loss").bool()
        agg = global_batch_kwargs(info, cfg.loss_scale_factor)
        terms = []
        if cfg.kl_coef:
            log_prob = _get(model_output, "log_probs", "distill loss (model_output)")
            kl = reverse_kl(log_prob, _get(data, TEACHER_LOG_PROBS, "distill loss"), cfg.kl_estimator)
            kl = torch.where(mask, kl, torch.zeros_like(kl))
            kl_loss = agg_loss(kl, mask, cfg.loss_agg_mode, **agg)
            terms.append(cfg.kl_coef * kl_loss)
            metrics["actor/distill_kl_loss"] = Metric.sum(kl_loss)
            metrics["actor/distill_kl"] = Metric.token_mean(kl.detach(), mask)
        if cfg.top_k_coef:
            if "gathered_log_probs" not in model_output.keys():
                raise KeyError(
                    "distill loss: top_k_coef > 0 needs model_output['gathered_log_probs'] [b, t, k], which "
                    "the engine computes when the batch holds 'teacher_topk_ids' (not under Ulysses SP, "
                    "tensor or pipeline parallelism); check that the teacher wrote them, or set top_k=0")
            student = model_output["gathered_log_probs"]
            teacher = _get(data, TEACHER_TOPK_LOG_PROBS, "distill loss")
            fkl = topk_forward_kl(teacher, student, cfg.top_k_normalization)
            fkl = torch.where(mask, fkl, torch.zeros_like(fkl))
            fkl_loss = agg_loss(fkl, mask, cfg.loss_agg_mode, **agg)
            terms.append(cfg.top_k_coef * fkl_loss)
            metrics["actor/distill_topk_kl_loss"] = Metric.sum(fkl_loss)
        total = sum(terms[1:], terms[0])
        return (total if loss is None else loss + total), metrics
