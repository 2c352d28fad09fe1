"""Packed (varlen) attention without a Python loop per segment: one call per segment length.

Where no fused varlen kernel exists (CPU; CUDA in fp32 or without one), the segments of a packed row are
grouped by length; each group (a *bucket*) is one batched call with no padding and no mask beyond the
causal (or sliding-window) one:

* buckets of segments up to the layout's crossover (:func:`matmul_crossover`; CPU without dropout only)
  run as batched matmuls with a hand-written backward (:func:`matmul_attention_forward`); half precision
  runs them upcast to fp32 and rounds once at the end;
* the others run as one ``scaled_dot_product_attention`` over ``[count, H, length, D]``.

Invariants: every packed token belongs to exactly one bucket, so each output and gradient row is written
once (no scatter-add, no zero fill); no token attends across segments; the result equals a per-segment
sdpa loop to fp32 round-off (sdpa buckets bitwise; matmul buckets sum in another order). How the
crossover is chosen: ``verl_trainer.models.attention_autotune`` and docs/internals.md.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F  # noqa: N812

from verl_trainer.models.varlen_kernels import sliding_window_mask

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx

_SOFTMAX_FAST_WIDTH = 16
"""Below this row width torch's CPU softmax is slower than max / exp / sum written out (measured)."""


MATMUL_MAX_LENGTH = 64
"""Crossover of a layout nobody measured (fp32; tuned on 4 / 2 heads x 64): the constant rule."""

LAYOUT_CROSSOVERS: dict[tuple[int, int, int, torch.dtype], int] = {}
"""Measured crossover per CPU layout ``(H, H_kv, D, dtype)``: filled at model build, the same on every
rank, by ``verl_trainer.models.attention_autotune``."""


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


def matmul_crossover(query: torch.Tensor, key: torch.Tensor, dropout: float) -> int:
    """The ``matmul_max_length`` for attention over ``query [1, H, N, D]`` and ``key [1, H_kv, N, D]``.

    0 where the matmul path does not apply (not on CPU, dropout, autocast); the layout's measured crossover
    where :data:`LAYOUT_CROSSOVERS` has one (half precision included: its matmuls run upcast to fp32);
    else the constant rule, :data:`MATMUL_MAX_LENGTH` in fp32 and 0 in half precision.
    """
    if not use_matmul_attention(query.dtype, query.device, dropout, upcast=True):
        return 0
    tuned = LAYOUT_CROSSOVERS.get((query.shape[1], key.shape[1], query.shape[3], query.dtype))
    if tuned is not None:
        return tuned
    return MATMUL_MAX_LENGTH if query.dtype == torch.float32 else 0


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


@dataclass(frozen=True)
class BucketPlan:
    """The segments of a packed row grouped by length, and where each bucket's rows come from.

    Rows are addressed in units of ``[N * H_kv, F / H_kv]`` (a token is ``H_kv`` consecutive rows, one per
    KV-head group), so a bucket can be read token-major (sdpa buckets: rows ``(segment, token, kv head)``)
    or KV-head-major (matmul buckets: rows ``(segment, kv head, token)``, the matrices of
    :func:`matmul_attention_forward`) with the same index.

    Attributes:
        shapes: ``(count, length)`` of each bucket, shortest length first.
        matmul: Per bucket, whether it runs the matmul path (rows KV-head-major) rather than sdpa.
        heads_kv: ``H_kv``, the rows per token.
        starts: Per bucket, the first token when its segments lie side by side in the row (it is read as a
            view, or one transposing copy when KV-head-major), else ``None`` (its rows are gathered).
        gather: ``[G]`` long, the rows of the gathered buckets, bucket after bucket.
        offsets: Per bucket, where its rows start in ``gather`` (``None`` for a run).

    """

    shapes: tuple[tuple[int, int], ...]
    matmul: tuple[bool, ...]
    heads_kv: int
    starts: tuple[int | None, ...]
    gather: torch.Tensor
    offsets: tuple[int | None, ...]

    @functools.cached_property
    def sizes(self) -> tuple[int, ...]:
        """Rows (``[N * H_kv]`` units) of each bucket (computed once per plan: plans are cached)."""
        return tuple(count * length * self.heads_kv for count, length in self.shapes)

    @functools.cached_property
    def sdpa(self) -> tuple[int, ...]:
        """The buckets that run sdpa (not the matmul path), in bucket order."""
        return tuple(i for i, kv_major in enumerate(self.matmul) if not kv_major)

    def indices(self, i: int) -> torch.Tensor:
        """``[count * length * H_kv]`` long, the rows of gathered bucket ``i`` (a view of ``gather``)."""
        start = self.offsets[i]
        assert start is not None, f"bucket {i} is a run of the row, not gathered"
        return self.gather[start : start + self.sizes[i]]


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
        if side_by_side:
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


def _read(plan: BucketPlan, units: torch.Tensor, i: int) -> torch.Tensor:
    """The rows of bucket ``i`` from ``units`` ``[N * H_kv, F']``, in its order (``[rows, F']``).

    A run of the row is a view (token-major) or one transposing copy (KV-head-major); others a gather.
    """
    start = plan.starts[i]
    if start is None:
        return units.index_select(0, plan.indices(i))
    first = start * plan.heads_kv
    rows = units[first : first + plan.sizes[i]]
    if not plan.matmul[i] or plan.heads_kv == 1:
        return rows
    count, length = plan.shapes[i]
    return rows.view(count, length, plan.heads_kv, -1).transpose(1, 2).reshape(rows.shape)


def _write(plan: BucketPlan, units: torch.Tensor, i: int, part: torch.Tensor) -> None:
    """Write the rows of bucket ``i`` (in its order, ``[rows, F']``) into ``units`` ``[N * H_kv, F']``.

    Gathered buckets go back by ``index_copy_`` (each row written once; on CPU it measured faster than
    ``index_put_`` with the same index).
    """
    part = part.to(units.dtype)
    start = plan.starts[i]
    if start is None:
        units.index_copy_(0, plan.indices(i), part)
        return
    first = start * plan.heads_kv
    rows = units[first : first + part.shape[0]]
    if not plan.matmul[i] or plan.heads_kv == 1:
        rows.copy_(part)
        return
    count, length = plan.shapes[i]
    kv_major = part.view(count, plan.heads_kv, length, -1)
    rows.view(count, length, plan.heads_kv, -1).copy_(kv_major.transpose(1, 2))


def _sdpa_layout(plan: BucketPlan, i: int, rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Token-major rows of sdpa bucket ``i`` ``[count * length * H_kv, F']`` as ``[count, heads, length, D]``.

    A view: the sdpa inputs and output gradients cross the autograd functions in sdpa's layout, so the
    per-bucket reshapes are not recorded (one autograd node per bucket: the sdpa call).
    """
    count, length = plan.shapes[i]
    return rows.view(count, length, heads, -1).transpose(1, 2)


def _rows_layout(x: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """``[count, h, length, D]`` (sdpa's layout) as token-major rows ``[count * length * H_kv, F']``.

    The inverse of :func:`_sdpa_layout` (a copy unless already laid out as ``[count, length, h, D]``).
    """
    return x.transpose(1, 2).reshape(x.shape[0] * x.shape[2] * heads_kv, -1)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[1, H, N, D]`` -> ``[N, H * D]`` (free for HF's layout, a transposed ``[1, N, H, D]``)."""
    return x.transpose(1, 2).reshape(x.shape[2], -1)


def _units(x: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """Rows ``[N, F]`` as ``[N * H_kv, F / H_kv]`` (a view)."""
    return x.view(x.shape[0] * heads_kv, -1)


class _Buckets(torch.autograd.Function):
    """Runs the short buckets and reads the sdpa buckets' rows.

    Forward: ``(q [1, H, N, D], k [1, H_kv, N, D], v [1, H_kv, N, D_v])`` -> ``(out [N, H * D_v], *q_parts,
    *k_parts, *v_parts)``: ``out`` holds the short buckets' rows (the sdpa buckets' rows are written
    by :class:`_PutRows`); the parts are the sdpa buckets' inputs in sdpa's layout (views), q
    ``[count, H, length, D]``, k and v ``[count, H_kv, length, D]``.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        plan: BucketPlan,
        heads: int,
        scale: float,
        is_causal: bool,
        window: int | None,
    ) -> tuple[torch.Tensor, ...]:
        ctx.shapes = (query.shape, key.shape, value.shape)
        query, key, value = (_rows(x) for x in (query, key, value))
        heads_kv, n = plan.heads_kv, query.shape[0]
        group = heads // heads_kv
        q, k, v = (_units(x, heads_kv) for x in (query, key, value))
        out = query.new_empty(n, heads * value.shape[1] // heads_kv)
        out_units = _units(out, heads_kv)
        saved = []
        for i, (count, length) in enumerate(plan.shapes):
            if not plan.matmul[i]:
                continue
            batch = count * heads_kv
            qb = _read(plan, q, i).view(batch, length * group, -1).float()  # half precision: in fp32
            kb, vb = (_read(plan, x, i).view(batch, length, -1).float() for x in (k, v))
            mask = additive_mask(length, group, is_causal, window, query.device)
            ob, probs = matmul_attention_forward(qb, kb, vb, mask, scale)
            _write(plan, out_units, i, ob.view(count * length * heads_kv, -1))
            saved += [qb, kb, vb, probs]
        ctx.save_for_backward(*saved)
        ctx.plan, ctx.scale = plan, scale
        sources = zip((q, k, v), (heads, heads_kv, heads_kv))
        return out, *(_sdpa_layout(plan, i, _read(plan, x, i), h) for x, h in sources for i in plan.sdpa)

    @staticmethod
    def backward(
        ctx: FunctionCtx, grad_out: torch.Tensor, *grad_parts: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        plan: BucketPlan = ctx.plan
        n = grad_out.shape[0]
        grads = [grad_out.new_empty(n, h * d) for _, h, _, d in ctx.shapes]
        units = [_units(g, plan.heads_kv) for g in grads]
        dout = _units(grad_out.contiguous(), plan.heads_kv)
        saved = iter(ctx.saved_tensors)
        parts = iter(grad_parts)
        for i, kv_major in enumerate(plan.matmul):
            if not kv_major:
                continue
            qb, kb, vb, probs = next(saved), next(saved), next(saved), next(saved)
            dob = _read(plan, dout, i).view(qb.shape[0], qb.shape[1], -1).float()
            d = matmul_attention_backward(dob, qb, kb, vb, probs, ctx.scale)
            for x, dx in zip(units, d):
                _write(plan, x, i, dx.view(-1, x.shape[1]))
        for x in units:
            for i in plan.sdpa:
                _write(plan, x, i, _rows_layout(next(parts), plan.heads_kv))
        as_inputs = (g.view(1, n, h, d).transpose(1, 2) for g, (_, h, _, d) in zip(grads, ctx.shapes))
        return *as_inputs, None, None, None, None, None


class _PutRows(torch.autograd.Function):
    """Writes the sdpa buckets' outputs into ``out`` (in place) next to the short buckets' rows.

    Forward: ``(plan, out [N, H * D_v], *outs)`` with ``outs`` the sdpa outputs ``[count, H, length, D_v]``;
    the backward hands their gradients back in that layout (views of the output gradient's rows).
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx, plan: BucketPlan, out: torch.Tensor, *parts: torch.Tensor
    ) -> torch.Tensor:
        ctx.plan = plan
        ctx.heads = parts[0].shape[1]
        units = _units(out, plan.heads_kv)
        for i, part in zip(plan.sdpa, parts):
            _write(plan, units, i, _rows_layout(part, plan.heads_kv))
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(
        ctx: FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        plan: BucketPlan = ctx.plan
        units = _units(grad.contiguous(), plan.heads_kv)
        return None, grad, *(_sdpa_layout(plan, i, _read(plan, units, i), ctx.heads) for i in plan.sdpa)


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
    matmul_max_length: int | None = None,
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
            (:func:`matmul_attention_forward`, in fp32: half-precision buckets are upcast) where that
            path applies (CPU, no dropout, no autocast); longer ones, and all others, one sdpa call.
            0: sdpa everywhere. ``None``: the layout's crossover (:func:`matmul_crossover`).

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
    if matmul_max_length is None:
        matmul_max = matmul_crossover(query, key, dropout)
    else:
        usable = use_matmul_attention(query.dtype, query.device, dropout, upcast=True)
        matmul_max = matmul_max_length if usable else 0
    plan = plan_buckets(lengths, query.device, heads_kv=heads_kv, matmul_max_length=matmul_max)
    out, *parts = _Buckets.apply(query, key, value, plan, heads, scale, is_causal, window)
    n_sdpa = len(plan.sdpa)
    outs = []
    qs, ks, vs = parts[:n_sdpa], parts[n_sdpa : 2 * n_sdpa], parts[2 * n_sdpa :]
    for i, q, k, v in zip(plan.sdpa, qs, ks, vs):  # q [count, H, length, D], k, v [count, H_kv, length, D]
        mask = None if window is None else sliding_window_mask(plan.shapes[i][1], window, query.device)
        outs.append(F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal and mask is None, scale=scale,
            enable_gqa=heads != heads_kv,
        ))  # [count, H, length, D_v], laid out as [count, length, H, D_v]
    if outs:
        out = _PutRows.apply(plan, out, *outs)
    return out.view(1, n, heads, dim_v)
