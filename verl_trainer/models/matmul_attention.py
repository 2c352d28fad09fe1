"""Attention over a bucket of short, equal-length segments through batched matmuls (the CPU short path).

For segments of up to a few dozen tokens the CPU flash-attention kernel costs about the same per token
whatever the length (its work per (segment, head) pair is mostly fixed), so a bucket of short segments
is cheaper as plain batched matmuls with a softmax in between, the backward written out by hand:

* layout: one matrix per (segment, KV head) with the ``g = H / H_kv`` query heads that share the KV
  head stacked along the rows (row ``r`` = position ``r // g``, head ``r % g``): ``q [C * H_kv, L * g,
  D]``, ``k, v [C * H_kv, L, D]`` — GQA costs no repeated keys, and the rows come from the packed
  rows with one copy each way;
* forward: ``P = softmax(scale * q k^T + mask)``, ``out = P v``; ``P`` ``[C * H_kv, L * g, L]`` is saved
  (for ``L <= D`` no larger than ``q``), so the backward is four matmuls and no recomputation.

The results equal the per-segment sdpa reference to fp32 round-off (not bitwise: another summation
order). :func:`bucketed_varlen_attention` uses it for buckets up to :data:`MATMUL_MAX_LENGTH` tokens in
fp32 without dropout; ``bench/attention.py`` measures both sides.
"""

from __future__ import annotations

import functools

import torch

MATMUL_MAX_LENGTH = 64
"""Longest segment (tokens) the matmul path takes; longer buckets run sdpa (set by ``bench/attention.py``)."""

_SOFTMAX_FAST_WIDTH = 16
"""Below this row width torch's CPU softmax is slower than max / exp / sum written out (measured)."""


def use_matmul_attention(dtype: torch.dtype, device: torch.device, dropout: float) -> bool:
    """Whether short buckets may take the matmul path: fp32 on CPU, no dropout, no autocast."""
    return (
        dtype == torch.float32
        and device.type == "cpu"
        and dropout == 0.0
        and not torch.is_autocast_enabled("cpu")
    )


@functools.lru_cache(maxsize=64)
def _additive_mask(
    length: int, group: int, is_causal: bool, window: int | None, device: torch.device
) -> torch.Tensor:
    """``[L * g, L]`` float32: 0 where row ``r`` (position ``r // g``) may read key ``j``, else ``-inf``."""
    query = torch.arange(length * group, device=device)[:, None] // group
    key = torch.arange(length, device=device)[None, :]
    allowed = torch.ones(length * group, length, dtype=torch.bool, device=device)
    if is_causal:
        allowed &= key <= query
    if window is not None:
        allowed &= query - key < window
    return torch.zeros(allowed.shape, device=device).masked_fill_(~allowed, float("-inf"))


def _softmax_(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim, in place where that is faster (short rows)."""
    if scores.shape[-1] >= _SOFTMAX_FAST_WIDTH:
        return torch.softmax(scores, -1)
    scores.sub_(scores.amax(-1, keepdim=True)).exp_()
    return scores.div_(scores.sum(-1, keepdim=True))


class _MatmulAttention(torch.autograd.Function):
    """Attention within ``C`` segments of ``L`` tokens given as matrices; see :func:`matmul_attention`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        shape: tuple[int, int, int, int],
        scale: float,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        count, length, heads, heads_kv = shape
        batch, rows = count * heads_kv, length * heads // heads_kv
        q, k, v = query.view(batch, rows, -1), key.view(batch, length, -1), value.view(batch, length, -1)
        probs = _softmax_(torch.baddbmm(mask, q, k.transpose(1, 2), alpha=scale))
        ctx.save_for_backward(q, k, v, probs)
        ctx.scale = scale  # type: ignore[attr-defined]
        return torch.bmm(probs, v).view(query.shape[0], -1)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, probs = ctx.saved_tensors  # type: ignore[attr-defined]
        dout = grad_out.contiguous().view(q.shape[0], q.shape[1], -1)
        dv = torch.bmm(probs.transpose(1, 2), dout)
        dscores = torch.bmm(dout, v.transpose(1, 2))  # dP
        # dS = P * (dP - rowsum(P * dP)) * scale, where rowsum(P * dP) = rowsum(dout * out)
        dscores.sub_((dscores * probs).sum(-1, keepdim=True)).mul_(probs).mul_(ctx.scale)  # type: ignore[attr-defined]
        dq = torch.bmm(dscores, k).view(-1, q.shape[1] // k.shape[1] * q.shape[2])
        dk = torch.bmm(dscores.transpose(1, 2), q).view(-1, k.shape[2])
        return dq, dk, dv.view(-1, v.shape[2]), None, None, None


def matmul_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    shape: tuple[int, int, int, int],
    *,
    scale: float,
    is_causal: bool,
    window: int | None,
) -> torch.Tensor:
    """Attention within each of ``C`` segments of ``L`` tokens, given KV-head-major.

    Row ``(c * H_kv + h) * L + i`` holds token ``i`` of segment ``c`` for KV head ``h``: for the query,
    its ``g = H / H_kv`` heads of that group side by side (``g * D`` wide), so each ``(c, h)`` is one
    ``[L * g, D]`` matrix whose row ``r`` is position ``r // g``.

    Args:
        query: ``[C * H_kv * L, g * D]``.
        key: ``[C * H_kv * L, D]``.
        value: ``[C * H_kv * L, D_v]``.
        shape: ``(C, L, H, H_kv)``.
        scale: Softmax scale.
        is_causal: Causal attention within each segment.
        window: Sliding window (keys ``i - window < j <= i``) or ``None``.

    Returns:
        ``[C * H_kv * L, g * D_v]``, rows as the query's.

    """
    _, length, heads, heads_kv = shape
    mask = _additive_mask(length, heads // heads_kv, is_causal, window, query.device)
    return _MatmulAttention.apply(query, key, value, shape, scale, mask)
