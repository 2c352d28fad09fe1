"""The distillation block of the invariance matrix: its loss functions and the teacher's batch fields.

The teacher's outputs are inputs of the batch (``teacher_log_probs [B, T]``, ``teacher_topk_ids`` and
``teacher_topk_log_probs [B, T, k]``), so each loss is a pure function of the batch and the student's
forward; the engine computes the student's ``gathered_log_probs`` of the top-k ids from the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict

from verl_trainer.core_algos.distill import DistillLoss, DistillLossConfig

TOP_K = 4
"""Teacher ids per position."""
TEACHER_SEED = 7


def distill_loss_fn(loss: str, agg: str, factor: float | None) -> Callable[..., Any]:
    """``distill_k1`` / ``distill_k3``: the reverse-KL loss term alone; ``distill_topk``: the top-k forward
    KL (``tail``) plus half the k3 term."""
    if loss == "distill_topk":
        cfg = DistillLossConfig(kl_coef=0.5, kl_estimator="k3", top_k_coef=1.0, top_k_normalization="tail",
                                loss_agg_mode=agg, loss_scale_factor=factor)
    else:
        cfg = DistillLossConfig(kl_coef=1.0, kl_estimator=loss.removeprefix("distill_"), loss_agg_mode=agg,
                                loss_scale_factor=factor)
    return DistillLoss(cfg)


def distill_batch(batch: TensorDict, vocab_low: int, vocab_high: int, top_k: bool) -> TensorDict:
    """``batch`` with a teacher's fields, seeded: log-probs ``log_probs_0 + noise`` of the sampled tokens
    (read off ``ref_log_prob``) and, with ``top_k``, ``TOP_K`` distinct ids per response position with
    log-probs of a random distribution over them (total mass 0.9: the tail holds 0.1)."""
    g = torch.Generator().manual_seed(TEACHER_SEED)
    batch = batch.clone()
    mask = batch["response_mask"]
    shape = mask.shape
    batch["teacher_log_probs"] = (batch["ref_log_prob"] - 0.5 * torch.rand(shape, generator=g)) * mask
    if top_k:
        scores = torch.rand((*shape, vocab_high - vocab_low), generator=g)
        ids = torch.topk(scores, TOP_K, -1).indices + vocab_low
        log_probs = torch.log_softmax(torch.randn((*shape, TOP_K), generator=g), -1) + torch.tensor(0.9).log()
        batch["teacher_topk_ids"] = ids * mask.long()[..., None]
        batch["teacher_topk_log_probs"] = log_probs * mask[..., None]
    return batch
