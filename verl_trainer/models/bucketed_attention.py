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

from verl_trainer.models.matmul_attention import MATMUL_MAX_LENGTH, matmul_attention, use_matmul_attention
from verl_trainer.models.varlen_kernels import sliding_window_mask


@dataclass(frozen=True)
class BucketPlan:
    """The segments of a packed row grouped by length, and where each bucket's rows come from.

    Rows are addressed in units of ``[N * H_kv, F / H_kv]`` (a token is ``H_kv`` consecutive rows, one per
    KV-head group), so a bucket can be read token-major (sdpa buckets: rows ``(segment, token, kv head)``)
    or KV-head-major (matmul buckets: rows ``(segment, kv head, token)``, the matrices of
    ``verl_trainer.models.matmul_attention``) with the same index.

    Attributes:
        shapes: ``(count, length)`` of each bucket, shortest length first.
        matmul: Per bucket, whether it runs the matmul path (rows KV-head-major) rather than sdpa.
        heads_kv: ``H_kv``, the rows per token.
        starts: Per bucket, the first token when its rows are one run of the row (it runs on a view: its
            segments lie side by side and its row order is the row's), else ``None`` (its rows are gathered).
        gather: ``[G]`` long, the rows of the gathered buckets, bucket after bucket.
        offsets: Per bucket, where its rows start in ``gather`` (``None`` for a run).

    """

    shapes: tuple[tuple[int, int], ...]
    matmul: tuple[bool, ...]
    heads_kv: int
    starts: tuple[int | None, ...]
    gather: torch.Tensor
    offsets: tuple[int | None, ...]

    def sizes(self) -> list[int]:
        """Rows (``[N * H_kv]`` units) of each bucket."""
        return [count * length * self.heads_kv for count, length in self.shapes]

    def indices(self, i: int) -> torch.Tensor:
        """``[count * length * H_kv]`` long, the rows of gathered bucket ``i`` (a view of ``gather``)."""
        start = self.offsets[i]
        assert start is not None, f"bucket {i} is a run of the row, not gathered"
        return self.gather[start : start + self.sizes()[i]]


@functools.lru_cache(maxsize=8)
def _cached_plan(
    lengths: tuple[int, ...], heads_kv: int, matmul_max_length: int, device: torch.device
) -> BucketPlan:
    first = [0]
    for n in lengths[:-1]:
        first.append(first[-1] + n)
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        if n > 0:
            by_length.setdefault(n, []).append(i)
    shapes, matmul, starts, offsets, gathered = [], [], [], [], []
    taken = 0
    heads = torch.arange(heads_kv)
    for length in sorted(by_length):
        segments = by_length[length]
        shapes.append((len(segments), length))
        kv_major = length <= matmul_max_length
        matmul.append(kv_major)
        side_by_side = all(first[b] == first[a] + length for a, b in zip(segments, segments[1:]))
        if side_by_side and (not kv_major or heads_kv == 1):
            starts.append(first[segments[0]])
            offsets.append(None)
            continue
        starts.append(None)
        offsets.append(taken)
        tokens = torch.tensor([first[i] for i in segments])[:, None] + torch.arange(length)[None, :]
        rows = tokens[:, :, None] * heads_kv + heads  # [count, length, H_kv]
        gathered.append((rows.transpose(1, 2) if kv_major else rows).reshape(-1))
        taken += len(segments) * length * heads_kv
    gather = torch.cat(gathered) if gathered else torch.zeros(0, dtype=torch.long)
    return BucketPlan(
        tuple(shapes), tuple(matmul), heads_kv, tuple(starts), gather.to(device), tuple(offsets)
    )


def plan_buckets(
    lengths: Sequence[int],
    device: torch.device | str = "cpu",
    *,
    heads_kv: int = 1,
    matmul_max_length: int = 0,
) -> BucketPlan:
    """Group the segments of a packed row by length (cached: every layer of a forward reuses the plan).

    Args:
        lengths: Length of each segment (0 allowed: empty segments are skipped).
        device: Device of the index tensor.
        heads_kv: KV heads of the attention (rows per token).
        matmul_max_length: Buckets of segments up to this length run the matmul path (0: none).

    Returns:
        The :class:`BucketPlan`.

    """
    if any(n < 0 for n in lengths):
        raise ValueError(f"segment lengths must be >= 0, got {list(lengths)}")
    return _cached_plan(tuple(int(n) for n in lengths), heads_kv, matmul_max_length, torch.device(device))


class _Gather(torch.autograd.Function):
    """Rows ``[N, F]`` -> one ``[count * length * H_kv, F / H_kv]`` tensor per bucket (a view for a run)."""

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
    """The inverse of :class:`_Gather`: one tensor per bucket -> rows ``[N, F]``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, plan: BucketPlan, num_tokens: int, *parts: torch.Tensor
    ) -> torch.Tensor:
        ctx.plan = plan  # type: ignore[attr-defined]
        width = parts[0].shape[1] * plan.heads_kv
        return _write_rows(plan, parts[0].new_empty(num_tokens, width), parts)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        return None, None, *_read_rows(ctx.plan, grad.contiguous())  # type: ignore[attr-defined]


def _read_rows(plan: BucketPlan, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each bucket's rows of ``x`` ``[N, F]``: a view for a run of the row, else one shared gather."""
    units = x.view(x.shape[0] * plan.heads_kv, -1)
    sizes = plan.sizes()
    gathered = units.index_select(0, plan.gather).split([n for n, s in zip(sizes, plan.starts) if s is None])
    parts = iter(gathered)
    per = plan.heads_kv
    return tuple(next(parts) if s is None else units[s * per : s * per + n]
                 for n, s in zip(sizes, plan.starts))


def _write_rows(plan: BucketPlan, out: torch.Tensor, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Write each bucket's rows into ``out`` ``[N, F]`` (every row once: the buckets partition the row)."""
    units = out.view(out.shape[0] * plan.heads_kv, -1)
    for i, (part, start) in enumerate(zip(parts, plan.starts)):
        if start is None:
            units.index_put_((plan.indices(i),), part)
        else:
            units[start * plan.heads_kv : start * plan.heads_kv + part.shape[0]] = part
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
    matmul_max_length: int = MATMUL_MAX_LENGTH,
) -> torch.Tensor:
    """Attention within each segment of a packed row, one call per distinct segment length.

    Args:
        query: ``[1, H, N, D]``.
        key: ``[1, H_kv, N, D]`` (``H % H_kv == 0``).
        value: ``[1, H_kv, N, D_v]``.
        lengths: The ``S`` segment lengths (sum ``N``; zeros allowed).
        scaling: Softmax scale (default ``D ** -0.5``).
        dropout: Attention dropout probability.
        is_causal: Causal attention within each segment.
        window: Sliding window (query ``i`` reads keys ``i - window < j <= i``), causal only; ``None``: off.
        matmul_max_length: Buckets of segments up to this length run batched matmuls
            (``verl_trainer.models.matmul_attention``) where that path applies (fp32 on CPU, no dropout);
            longer ones, and all others, one sdpa call. 0: sdpa everywhere.

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
    scale = query.shape[3] ** -0.5 if scaling is None else scaling
    matmul_max = matmul_max_length if use_matmul_attention(query.dtype, query.device, dropout) else 0
    plan = plan_buckets(lengths, query.device, heads_kv=heads_kv, matmul_max_length=matmul_max)
    buckets = zip(*(_Gather.apply(_rows(x), plan) for x in (query, key, value)), plan.shapes, plan.matmul)
    outs = []
    for q, k, v, (count, length), kv_major in buckets:
        if kv_major:
            shape = (count, length, heads, heads_kv)
            outs.append(matmul_attention(q, k, v, shape, scale=scale, is_causal=is_causal, window=window))
            continue
        mask = None if window is None else sliding_window_mask(length, window, query.device)
        out = F.scaled_dot_product_attention(
            q.view(count, length, heads, -1).transpose(1, 2),
            k.view(count, length, heads_kv, -1).transpose(1, 2),
            v.view(count, length, heads_kv, dim_v).transpose(1, 2),
            attn_mask=mask,
            dropout_p=dropout,
            is_causal=is_causal and mask is None,
            scale=scale,
            enable_gqa=heads != heads_kv,
        )  # [count, H, length, D_v], laid out as [count, length, H, D_v]
        outs.append(out.transpose(1, 2).reshape(count * length * heads_kv, -1))
    return _Scatter.apply(plan, n, *outs).view(1, n, heads, dim_v)
