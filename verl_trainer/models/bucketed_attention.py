"""Packed (varlen) attention without a Python loop per segment: segments bucketed by length.

Where no fused varlen kernel exists (CPU; CUDA in fp32 or without one), the segments of a packed row are
sorted by length and grouped into a few buckets; each bucket is one batched ``scaled_dot_product_attention``
call over its segments, right-padded to the bucket's longest segment. With right padding, causal attention
needs no extra mask: a real query ``i`` only reads keys ``<= i``, which are real tokens of its own segment.
The padded query rows compute something and are dropped.

A segment alone in its bucket runs on a view of the row (no copy), as in a per-segment loop. The
buckets of several segments move their tokens with one row gather each way (:class:`_Split`,
:class:`_Merge`), and the backward writes every token's gradient once (never a scatter-add): every
packed token owns exactly one padded row, and the gradient reaching a padding row is exactly zero
(padding queries get a zero output gradient; no real query attends to a padding key), so dropping it
is exact. The inputs are read as rows ``[N, H * D]``: free for HF's layout (a transposed
``[1, N, H, D]``), one copy otherwise.

How segments are bucketed (:func:`plan_buckets`): greedily over the sorted lengths, a segment joins the
current bucket while the padded work it adds to the bucket (``count * (L_new^2 - L_old^2)`` score
entries) stays below the cost of one more sdpa call (``call_cost``, in score entries, measured with
``bench/attention.py``; :data:`CALL_COST`). With the default 0, segments of equal length share a call:
1,024 segments of 8-16 tokens become 9 calls.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812

from verl_trainer.models.varlen_kernels import sliding_window_mask

CALL_COST = 0
"""Padded score entries one extra sdpa call is worth. Measured with ``bench/attention.py`` (fwd+bwd, CPU,
2 cores): 0 — one bucket per distinct length, no padding — beat 4,096 and 65,536 on every workload (the
padding costs more than the calls it saves here), and gives results bitwise equal to the per-segment loop."""


@dataclass(frozen=True)
class BucketPlan:
    """How the segments of a packed row map onto padded buckets (and segments alone in theirs).

    Attributes:
        shapes: ``(count, padded_length)`` of each bucket of two or more segments, in padded-row order.
        gather: ``[P]`` long, the packed token read into each padded row (a padding row reads its
            segment's first token; its result is dropped).
        valid: ``[P]`` bool, True at the padded rows that hold a real token.
        tokens: ``[T]`` long, the packed tokens of the buckets, in padded-row order (``gather[valid]``).
        rows: ``[T]`` long, the padded row of each of ``tokens``.
        singles: ``(start, length)`` of each segment alone in its bucket: it runs on a view of the row.

    """

    shapes: tuple[tuple[int, int], ...]
    gather: torch.Tensor
    valid: torch.Tensor
    tokens: torch.Tensor
    rows: torch.Tensor
    singles: tuple[tuple[int, int], ...]


def _group(lengths: Sequence[int], call_cost: int) -> list[list[int]]:
    """Segment indices (non-empty segments only) grouped into buckets, shortest first."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lengths.__getitem__)
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        n = lengths[i]
        if current and len(current) * (n * n - longest * longest) > call_cost:
            groups.append(current)
            current = []
        current.append(i)
        longest = n
    if current:
        groups.append(current)
    return groups


@functools.lru_cache(maxsize=8)
def _cached_plan(lengths: tuple[int, ...], call_cost: int, device: torch.device) -> BucketPlan:
    starts = torch.tensor([0, *lengths], dtype=torch.long).cumsum(0)[:-1]
    lens = torch.tensor(lengths, dtype=torch.long)
    shapes, gathers, valids, singles = [], [], [], []
    for group in _group(lengths, call_cost):
        if len(group) == 1:
            singles.append((int(starts[group[0]]), lengths[group[0]]))
            continue
        idx = torch.tensor(group, dtype=torch.long)
        width = int(lens[idx].max())
        col = torch.arange(width)[None, :]
        real = col < lens[idx][:, None]  # [count, width]
        gathers.append(torch.where(real, starts[idx][:, None] + col, starts[idx][:, None]).reshape(-1))
        valids.append(real.reshape(-1))
        shapes.append((len(group), width))
    gather = torch.cat(gathers) if gathers else torch.zeros(0, dtype=torch.long)
    valid = torch.cat(valids) if valids else torch.zeros(0, dtype=torch.bool)
    tokens, rows = gather[valid], torch.nonzero(valid).reshape(-1)
    moved = (t.to(device) for t in (gather, valid, tokens, rows))
    return BucketPlan(tuple(shapes), *moved, singles=tuple(singles))


def plan_buckets(
    lengths: Sequence[int], device: torch.device | str = "cpu", call_cost: int = CALL_COST
) -> BucketPlan:
    """Bucket the segments of a packed row (cached: every layer of a forward reuses the plan).

    Args:
        lengths: Length of each segment (0 allowed: empty segments are skipped).
        device: Device of the index tensors.
        call_cost: Padded score entries one more sdpa call is worth (``0``: one bucket per distinct length).

    Returns:
        The :class:`BucketPlan`.

    """
    if call_cost < 0:
        raise ValueError(f"call_cost must be >= 0, got {call_cost}")
    if any(n < 0 for n in lengths):
        raise ValueError(f"segment lengths must be >= 0, got {list(lengths)}")
    return _cached_plan(tuple(int(n) for n in lengths), int(call_cost), torch.device(device))


class _Split(torch.autograd.Function):
    """Rows ``[N, F]`` -> (the buckets' padded rows ``[P, F]``, a view per single segment ``[L, F]``).

    Backward writes every token's gradient once (a copy for single segments, one gather for the
    buckets): the gradient of a padding row is exactly zero, so it is dropped, not added.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, plan: BucketPlan
    ) -> tuple[torch.Tensor, ...]:
        ctx.plan, ctx.shape = plan, x.shape  # type: ignore[attr-defined]
        return (x.index_select(0, plan.gather), *(x[s : s + n] for s, n in plan.singles))

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_padded: torch.Tensor, *grad_singles: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        plan: BucketPlan = ctx.plan  # type: ignore[attr-defined]
        grad = grad_padded.new_empty(ctx.shape)  # type: ignore[attr-defined]
        grad.index_copy_(0, plan.tokens, grad_padded.index_select(0, plan.rows))
        for (s, n), g in zip(plan.singles, grad_singles):
            grad[s : s + n] = g
        return grad, None


class _Merge(torch.autograd.Function):
    """The inverse of :class:`_Split`: padded bucket rows and single-segment rows -> the packed ``[N, F]``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, plan: BucketPlan, num_tokens: int, padded: torch.Tensor,
        *singles: torch.Tensor,
    ) -> torch.Tensor:
        ctx.plan = plan  # type: ignore[attr-defined]
        out = padded.new_empty(num_tokens, padded.shape[1])
        out.index_copy_(0, plan.tokens, padded.index_select(0, plan.rows))
        for (s, n), rows in zip(plan.singles, singles):
            out[s : s + n] = rows
        return out

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        plan: BucketPlan = ctx.plan  # type: ignore[attr-defined]
        grad_padded = grad.index_select(0, plan.gather)
        grad_padded.masked_fill_(~plan.valid[:, None], 0)  # padding rows: no gradient
        return None, None, grad_padded, *(grad[s : s + n] for s, n in plan.singles)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[1, H, N, D]`` -> ``[N, H * D]`` (free for HF's layout, a transposed ``[1, N, H, D]``)."""
    return x[0].transpose(0, 1).reshape(x.shape[2], -1)


def _bucket_mask(
    count: int, width: int, valid: torch.Tensor, is_causal: bool, window: int | None, device: torch.device
) -> torch.Tensor | None:
    """Boolean sdpa mask of one bucket (True = attend), or ``None`` when ``is_causal`` alone is right."""
    if window is None:
        if is_causal:
            return None
        return valid.reshape(count, 1, 1, width)  # keys: the real tokens of the segment
    return sliding_window_mask(width, window, device)[None, None]


def bucketed_varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: Sequence[int],
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    is_causal: bool = True,
    window: int | None = None,
    call_cost: int = CALL_COST,
) -> torch.Tensor:
    """Attention within each segment of a packed row, one sdpa call per bucket of similar lengths.

    Args:
        query: ``[1, H, N, D]``.
        key: ``[1, H_kv, N, D]`` (``H % H_kv == 0``).
        value: ``[1, H_kv, N, D_v]``.
        lengths: The ``S`` segment lengths (sum ``N``; zeros allowed).
        scaling: Softmax scale (default ``D ** -0.5``).
        dropout: Attention dropout probability.
        is_causal: Causal attention within each segment.
        window: Sliding window (query ``i`` reads keys ``i - window < j <= i``), causal only; ``None``: off.
        call_cost: See :func:`plan_buckets`.

    Returns:
        ``[1, N, H, D_v]``.

    """
    if window is not None and not is_causal:
        raise NotImplementedError(f"a sliding window ({window}) needs causal attention; got is_causal=False")
    if window is not None and window < 1:
        raise ValueError(f"the sliding window must be >= 1 token, got {window}")
    n, heads, heads_kv, dim_v = query.shape[2], query.shape[1], key.shape[1], value.shape[3]
    plan = plan_buckets(lengths, query.device, call_cost)
    if n == 0:
        return query.new_zeros(1, 0, heads, dim_v)
    parts = [_Split.apply(_rows(x), plan) for x in (query, key, value)]  # ([P, F], *[L, F]) each
    sizes = [count * width for count, width in plan.shapes]
    shapes = [*plan.shapes, *((1, length) for _, length in plan.singles)]
    padded_qkv = [p[0].split(sizes) for p in parts]
    valids = [*plan.valid.split(sizes), *(None for _ in plan.singles)]
    outs = []
    for i, ((count, width), valid) in enumerate(zip(shapes, valids)):
        q, k, v = (pad[i] if i < len(sizes) else p[1 + i - len(sizes)] for pad, p in zip(padded_qkv, parts))
        mask = None
        if valid is not None or window is not None or not is_causal:
            real = valid if valid is not None else torch.ones(width, dtype=torch.bool, device=query.device)
            mask = _bucket_mask(count, width, real, is_causal, window, query.device)
        out = F.scaled_dot_product_attention(
            q.view(count, width, heads, -1).transpose(1, 2),
            k.view(count, width, heads_kv, -1).transpose(1, 2),
            v.view(count, width, heads_kv, dim_v).transpose(1, 2),
            attn_mask=mask,
            dropout_p=dropout,
            is_causal=is_causal and mask is None,
            scale=scaling,
            enable_gqa=heads != heads_kv,
        )  # [count, H, width, D_v]
        outs.append(out.transpose(1, 2).reshape(count * width, heads * dim_v))
    padded_out = torch.cat(outs[: len(sizes)]) if sizes else query.new_zeros(0, heads * dim_v)
    merged = _Merge.apply(plan, n, padded_out, *outs[len(sizes) :])
    return merged.view(1, n, heads, dim_v)
