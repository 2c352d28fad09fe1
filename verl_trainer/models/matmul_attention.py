"""Attention over a bucket of short, equal-length segments as batched matmuls (the CPU short path).

For segments of up to a few dozen tokens the CPU flash-attention kernel costs about the same per token
whatever the length, 1.3x what plain batched matmuls with a softmax in between cost (measured on
segments of 17-64 tokens; 1.1x at 65-128), so ``verl_trainer.models.bucketed_attention`` runs short
buckets here:

* layout: one matrix per (segment, KV head), the ``g = H / H_kv`` query heads that share the KV head
  side by side in each row, so the query is ``[C * H_kv, L * g, D]`` with row ``r`` = position ``r // g``
  and ``k, v`` are ``[C * H_kv, L, D]``: GQA repeats no keys, and one row gather of the packed row
  (rows of ``[N * H_kv, F / H_kv]``) reads a bucket in this order;
* forward: ``P = softmax(scale * q k^T + mask)``, ``out = P v``; ``P`` ``[C * H_kv, L * g, L]`` is kept
  (no larger than ``q`` for ``L <= D``), so the backward is four matmuls and no recomputation.

The results equal the per-segment sdpa reference to fp32 round-off (not bitwise: another summation
order). Used in fp32 on CPU without dropout for buckets up to the crossover length measured for the layout
(``verl_trainer.models.attention_autotune``), or :data:`MATMUL_MAX_LENGTH` tokens with the autotune off.
"""

from __future__ import annotations

import functools

import torch

from verl_trainer.models.varlen_kernels import sliding_window_mask

MATMUL_MAX_LENGTH = 64
"""Longest segment (tokens) the matmul path takes with the autotune off (tuned on 4 / 2 heads x 64)."""

_SOFTMAX_FAST_WIDTH = 16
"""Below this row width torch's CPU softmax is slower than max / exp / sum written out (measured)."""


def use_matmul_attention(dtype: torch.dtype, device: torch.device, dropout: float, *, upcast: bool = False
                         ) -> bool:
    """Whether short buckets may take the matmul path: fp32 on CPU, no dropout, no autocast.

    ``upcast``: bf16 / fp16 too (the bucket is upcast to fp32 for the matmuls and the result rounded back:
    not bitwise the half-precision sdpa, which rounds inside; only where the layout's autotune chose it).
    """
    dtypes = (torch.float32, torch.bfloat16, torch.float16) if upcast else (torch.float32,)
    return (
        dtype in dtypes
        and device.type == "cpu"
        and dropout == 0.0
        and not torch.is_autocast_enabled("cpu")
    )


@functools.lru_cache(maxsize=64)
def additive_mask(
    length: int, group: int, is_causal: bool, window: int | None, device: torch.device
) -> torch.Tensor:
    """``[L * g, L]`` float32: 0 where row ``r`` (position ``r // g``) may read key ``j``, else ``-inf``."""
    if window is not None:  # causal: the bucketed path refuses a window without it
        allowed = sliding_window_mask(length, window, device)
    else:
        allowed = torch.ones(length, length, dtype=torch.bool, device=device)
        if is_causal:
            allowed = allowed.tril()
    allowed = allowed.repeat_interleave(group, dim=0)
    return torch.zeros(allowed.shape, device=device).masked_fill_(~allowed, float("-inf"))


def _softmax_(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim, in place where that is faster (short rows)."""
    if scores.shape[-1] >= _SOFTMAX_FAST_WIDTH:
        return torch.softmax(scores, -1)
    scores.sub_(scores.amax(-1, keepdim=True)).exp_()
    return scores.div_(scores.sum(-1, keepdim=True))


def matmul_attention_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention within each matrix of a bucket (no autograd; :func:`matmul_attention_backward` is its own).

    Matrix ``b`` is one (segment, KV head): its rows are the segment's positions, for the query each
    position's ``g`` heads of that KV group one after another (row ``r`` = position ``r // g``).

    Args:
        query: ``[B, L * g, D]``.
        key: ``[B, L, D]``.
        value: ``[B, L, D_v]``.
        mask: ``[L * g, L]`` additive (:func:`additive_mask`).
        scale: Softmax scale.

    Returns:
        ``(out [B, L * g, D_v], probs [B, L * g, L])``; keep ``probs`` for the backward.

    """
    probs = _softmax_(torch.baddbmm(mask, query, key.transpose(1, 2), alpha=scale))
    return torch.bmm(probs, value), probs


def matmul_attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    probs: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`matmul_attention_forward`: four matmuls, nothing recomputed.

    Args:
        grad_out: ``[B, L * g, D_v]``.
        query: ``[B, L * g, D]``.
        key: ``[B, L, D]``.
        value: ``[B, L, D_v]``.
        probs: ``[B, L * g, L]`` from the forward.
        scale: Softmax scale.

    Returns:
        ``(d_query, d_key, d_value)`` shaped like the inputs.

    """
    d_value = torch.bmm(probs.transpose(1, 2), grad_out)
    d_scores = torch.bmm(grad_out, value.transpose(1, 2))  # dP
    # dS = P * (dP - rowsum(P * dP)) * scale, where rowsum(P * dP) = rowsum(dout * out)
    d_scores.sub_((d_scores * probs).sum(-1, keepdim=True)).mul_(probs).mul_(scale)
    return torch.bmm(d_scores, key), torch.bmm(d_scores.transpose(1, 2), query), d_value
