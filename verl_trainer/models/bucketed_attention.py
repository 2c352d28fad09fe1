"""Packed (varlen) attention without a Python loop per segment: one sdpa call per segment length.

Where no fused varlen kernel exists (CPU; CUDA in fp32 or without one), the segments of a packed row are
grouped by length; each group (a *bucket*) is one batched ``scaled_dot_product_attention`` call over
``[count, H, length, D]``. Segments of one bucket have equal lengths, so there is no padding and no mask
beyond the causal (or sliding-window) one; the results equal a per-segment loop to round-off (bitwise in
``bench/attention.py``'s workloads).

Data movement is one pass each way per tensor. A bucket whose segments lie side by side in the row (one
segment alone, or a row packed in length order) runs on a view of the row; the others are read with one
row gather per input (:class:`_Gather`) and written back with one ``index_copy_`` per bucket
(:class:`_Scatter`). Every packed token belongs to exactly one bucket, so both backwards write each
gradient row once: never a scatter-add, never a zero fill. The inputs are read as rows ``[N, H * D]``:
free for HF's layout (a transposed ``[1, N, H, D]``), one copy otherwise; the sdpa outputs and input
gradients come back in the ``[count, length, H, D]`` layout, so reading them as rows is free too.

Measured with ``bench/attention.py`` (fwd+bwd, CPU): padding segments of similar lengths into one call
(fewer, larger calls) lost to one call per distinct length on every workload — 1,024 segments of 8-16
tokens take 9 calls here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812

from verl_trainer.models.varlen_kernels import sliding_window_mask


@dataclass(frozen=True)
class BucketPlan:
    """The segments of a packed row grouped by length.

    Attributes:
        shapes: ``(count, length)`` of each bucket, shortest length first.
        starts: Per bucket, the first token when its ``count * length`` tokens are one run of the row
            (it runs on a view), else ``None`` (its tokens are gathered).
        gather: ``[G]`` long, the tokens of the gathered buckets, bucket after bucket, each bucket's
            segments in row order (``G`` = their tokens).
        offsets: Per bucket, where its tokens start in ``gather`` (``None`` for a run).

    """

    shapes: tuple[tuple[int, int], ...]
    starts: tuple[int | None, ...]
    gather: torch.Tensor
    offsets: tuple[int | None, ...]

    def sizes(self) -> list[int]:
        """Tokens of each bucket."""
        return [count * length for count, length in self.shapes]

    def indices(self, i: int) -> torch.Tensor:
        """``[count * length]`` long, the tokens of gathered bucket ``i`` (a view of ``gather``)."""
        start = self.offsets[i]
        assert start is not None, f"bucket {i} is a run of the row, not gathered"
        return self.gather[start : start + self.sizes()[i]]


@functools.lru_cache(maxsize=8)
def _cached_plan(lengths: tuple[int, ...], device: torch.device) -> BucketPlan:
    first = [0]
    for n in lengths[:-1]:
        first.append(first[-1] + n)
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        if n > 0:
            by_length.setdefault(n, []).append(i)
    shapes, starts, offsets, gathered = [], [], [], []
    taken = 0
    for length in sorted(by_length):
        segments = by_length[length]
        shapes.append((len(segments), length))
        run = all(first[b] == first[a] + length for a, b in zip(segments, segments[1:]))
        if run:
            starts.append(first[segments[0]])
            offsets.append(None)
            continue
        starts.append(None)
        offsets.append(taken)
        tokens = torch.tensor([first[i] for i in segments])[:, None] + torch.arange(length)[None, :]
        gathered.append(tokens.reshape(-1))
        taken += len(segments) * length
    gather = torch.cat(gathered) if gathered else torch.zeros(0, dtype=torch.long)
    return BucketPlan(tuple(shapes), tuple(starts), gather.to(device), tuple(offsets))


def plan_buckets(lengths: Sequence[int], device: torch.device | str = "cpu") -> BucketPlan:
    """Group the segments of a packed row by length (cached: every layer of a forward reuses the plan).

    Args:
        lengths: Length of each segment (0 allowed: empty segments are skipped).
        device: Device of the index tensor.

    Returns:
        The :class:`BucketPlan`.

    """
    if any(n < 0 for n in lengths):
        raise ValueError(f"segment lengths must be >= 0, got {list(lengths)}")
    return _cached_plan(tuple(int(n) for n in lengths), torch.device(device))


class _Gather(torch.autograd.Function):
    """Rows ``[N, F]`` -> one ``[count * length, F]`` tensor per bucket (a view for a run of the row)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, plan: BucketPlan
    ) -> tuple[torch.Tensor, ...]:
        ctx.plan, ctx.shape = plan, x.shape  # type: ignore[attr-defined]
        return _read_rows(plan, x)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, *grads: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        plan: BucketPlan = ctx.plan  # type: ignore[attr-defined]
        return _write_rows(plan, grads[0].new_empty(ctx.shape), grads), None  # type: ignore[attr-defined]


class _Scatter(torch.autograd.Function):
    """The inverse of :class:`_Gather`: one ``[count * length, F]`` tensor per bucket -> rows ``[N, F]``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, plan: BucketPlan, num_tokens: int, *parts: torch.Tensor
    ) -> torch.Tensor:
        ctx.plan = plan  # type: ignore[attr-defined]
        return _write_rows(plan, parts[0].new_empty(num_tokens, parts[0].shape[1]), parts)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        return None, None, *_read_rows(ctx.plan, grad)  # type: ignore[attr-defined]


def _read_rows(plan: BucketPlan, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each bucket's rows of ``x`` ``[N, F]``: a view for a run of the row, else one shared gather."""
    sizes = plan.sizes()
    gathered = x.index_select(0, plan.gather).split([n for n, s in zip(sizes, plan.starts) if s is None])
    parts = iter(gathered)
    return tuple(next(parts) if s is None else x[s : s + n] for n, s in zip(sizes, plan.starts))


def _write_rows(plan: BucketPlan, out: torch.Tensor, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Write each bucket's rows into ``out`` ``[N, F]`` (every row once: the buckets partition the row)."""
    for i, (part, start) in enumerate(zip(parts, plan.starts)):
        if start is None:
            out.index_copy_(0, plan.indices(i), part)
        else:
            out[start : start + part.shape[0]] = part
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[1, H, N, D]`` -> ``[N, H * D]`` (free for HF's layout, a transposed ``[1, N, H, D]``)."""
    return x.transpose(1, 2).reshape(x.shape[2], -1)  # not x[0]: its backward zero-fills a copy


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
) -> torch.Tensor:
    """Attention within each segment of a packed row, one sdpa call per distinct segment length.

    Args:
        query: ``[1, H, N, D]``.
        key: ``[1, H_kv, N, D]`` (``H % H_kv == 0``).
        value: ``[1, H_kv, N, D_v]``.
        lengths: The ``S`` segment lengths (sum ``N``; zeros allowed).
        scaling: Softmax scale (default ``D ** -0.5``).
        dropout: Attention dropout probability.
        is_causal: Causal attention within each segment.
        window: Sliding window (query ``i`` reads keys ``i - window < j <= i``), causal only; ``None``: off.

    Returns:
        ``[1, N, H, D_v]``.

    """
    if window is not None and not is_causal:
        raise NotImplementedError(f"a sliding window ({window}) needs causal attention; got is_causal=False")
    if window is not None and window < 1:
        raise ValueError(f"the sliding window must be >= 1 token, got {window}")
    n, heads, heads_kv, dim_v = query.shape[2], query.shape[1], key.shape[1], value.shape[3]
    if n == 0:
        return query.new_zeros(1, 0, heads, dim_v)
    plan = plan_buckets(lengths, query.device)
    buckets = zip(*(_Gather.apply(_rows(x), plan) for x in (query, key, value)), plan.shapes)
    outs = []
    for q, k, v, (count, length) in buckets:
        mask = None if window is None else sliding_window_mask(length, window, query.device)
        out = F.scaled_dot_product_attention(
            q.view(count, length, heads, -1).transpose(1, 2),
            k.view(count, length, heads_kv, -1).transpose(1, 2),
            v.view(count, length, heads_kv, dim_v).transpose(1, 2),
            attn_mask=mask,
            dropout_p=dropout,
            is_causal=is_causal and mask is None,
            scale=scaling,
            enable_gqa=heads != heads_kv,
        )  # [count, H, length, D_v], laid out as [count, length, H, D_v]
        outs.append(out.transpose(1, 2).reshape(count * length, heads * dim_v))
    return _Scatter.apply(plan, n, *outs).view(1, n, heads, dim_v)
