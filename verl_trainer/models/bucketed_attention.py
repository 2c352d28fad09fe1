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
    out: Sequence[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`matmul_attention_forward`: four matmuls, nothing recomputed.

    Args:
        grad_out: ``[B, L * g, D_v]``.
        query: ``[B, L * g, D]``.
        key: ``[B, L, D]``.
        value: ``[B, L, D_v]``.
        probs: ``[B, L * g, L]`` from the forward.
        scale: Softmax scale.
        out: ``(d_query, d_key, d_value)`` tensors to write into (contiguous, shaped like the inputs), or
            ``None`` (new tensors).

    Returns:
        ``(d_query, d_key, d_value)`` shaped like the inputs.

    """
    d_query, d_key, d_value = out if out is not None else (None, None, None)
    d_value = torch.bmm(probs.transpose(1, 2), grad_out, out=d_value)
    d_scores = torch.bmm(grad_out, value.transpose(1, 2))  # dP
    # dS = P * (dP - rowsum(P * dP)) * scale, where rowsum(P * dP) = rowsum(dout * out)
    d_scores.sub_((d_scores * probs).sum(-1, keepdim=True)).mul_(probs).mul_(scale)
    d_query = torch.bmm(d_scores, key, out=d_query)
    return d_query, torch.bmm(d_scores.transpose(1, 2), query, out=d_key), d_value


@dataclass(frozen=True)
class BucketPlan:
    """The segments of a packed row grouped by length, and where each bucket's rows are read and written.

    Rows are addressed in units of ``[N * H_kv, F / H_kv]`` (a token is ``H_kv`` consecutive rows, one per
    KV-head group). Each bucket's rows are in its kernel's order: token-major for sdpa buckets (rows
    ``(segment, token, kv head)``, read as ``[count, H, length, D]`` views) and KV-head-major for matmul
    buckets (rows ``(segment, kv head, token)``, the matrices of :func:`matmul_attention_forward`).

    A bucket of segments side by side in the row whose order is token-major (sdpa, or matmul with one KV
    head) is read and written *in place*, as a slice of the packed row; the others are *gathered*: one
    ``index_select`` per tensor brings all their rows, bucket after bucket, into one tensor (each bucket a
    slice of it), and one scatter takes them back (an ``index_select`` with the inverse permutation when
    every row is gathered, else ``index_copy_`` of the gathered rows). Data movement only: which rows are
    gathered never changes a result. Where more than half the rows would be gathered, all are (a gather
    is cheaper than a scatter on CPU).

    Attributes:
        shapes: ``(count, length)`` of each bucket, shortest length first.
        matmul: Per bucket, whether it runs the matmul path (rows KV-head-major) rather than sdpa.
        heads_kv: ``H_kv``, the rows per token.
        places: Per bucket ``(in_place, start)``: its rows are rows ``start : start + count * length *
            H_kv`` of the packed row (``in_place``) or of the gathered tensor.
        gather: ``[G]`` long, the packed-row rows of the gathered buckets, bucket after bucket; ``None``
            when no bucket is gathered.
        inverse: ``[N * H_kv]`` long, the inverse of ``gather`` when it is a permutation of every row,
            else ``None``.

    """

    shapes: tuple[tuple[int, int], ...]
    matmul: tuple[bool, ...]
    heads_kv: int
    places: tuple[tuple[bool, int], ...]
    gather: torch.Tensor | None
    inverse: torch.Tensor | None

    @property
    def sdpa(self) -> list[int]:
        """The buckets that run sdpa (not the matmul path), in bucket order."""
        return [i for i, kv_major in enumerate(self.matmul) if not kv_major]

    def gathered(self, units: torch.Tensor) -> torch.Tensor:
        """The gathered buckets' rows of packed-row ``units`` ``[N * H_kv, F']``, bucket after bucket."""
        if self.gather is None:
            return units.new_empty(0, units.shape[1])
        return units.index_select(0, self.gather)

    def part(self, units: torch.Tensor, gathered: torch.Tensor, i: int) -> torch.Tensor:
        """Bucket ``i``'s rows, in its order: a slice of packed-row ``units`` or of ``gathered``."""
        in_place, start = self.places[i]
        count, length = self.shapes[i]
        return (units if in_place else gathered)[start : start + count * length * self.heads_kv]

    def scatter(self, units: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
        """Packed-row rows: ``units`` (in-place buckets written) with the ``gathered`` rows put back."""
        if self.gather is None:
            return units
        if self.inverse is not None:
            return gathered.index_select(0, self.inverse)
        return units.index_copy_(0, self.gather, gathered)


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
    shapes, matmul, rows_of, in_place = [], [], [], []
    heads = torch.arange(heads_kv)
    for length in sorted(by_length):
        segments = by_length[length]
        shapes.append((len(segments), length))
        kv_major = length <= matmul_max_length
        matmul.append(kv_major)
        tokens = torch.tensor([first[i] for i in segments])[:, None] + torch.arange(length)[None, :]
        rows = tokens[:, :, None] * heads_kv + heads  # [count, length, H_kv]
        rows_of.append((rows.transpose(1, 2) if kv_major else rows).reshape(-1))
        side_by_side = all(first[b] == first[a] + length for a, b in zip(segments, segments[1:]))
        in_place.append(side_by_side and (not kv_major or heads_kv == 1))
    total = sum(rows.numel() for rows in rows_of)
    if 2 * sum(rows.numel() for rows, kept in zip(rows_of, in_place) if not kept) > total:
        in_place = [False] * len(rows_of)
    places, gathered, taken = [], [], 0
    for rows, kept in zip(rows_of, in_place):
        places.append((kept, int(rows[0]) if kept else taken))
        if not kept:
            gathered.append(rows)
            taken += rows.numel()
    gather = torch.cat(gathered) if gathered else None
    inverse = None
    if gather is not None and gather.numel() == total:
        if torch.equal(gather, torch.arange(total)):  # already in bucket order: nothing to move
            gather, places = None, [(True, start) for _, start in places]
        else:
            inverse = torch.empty_like(gather)
            inverse[gather] = torch.arange(total)
    return BucketPlan(
        tuple(shapes), tuple(matmul), heads_kv, tuple(places),
        None if gather is None else gather.to(device), None if inverse is None else inverse.to(device),
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
        device: Device of the index tensors.
        heads_kv: KV heads of the attention (rows per token).
        matmul_max_length: Buckets of segments up to this length run the matmul path (0: none).

    Returns:
        The :class:`BucketPlan`.

    """
    if any(n < 0 for n in lengths):
        raise ValueError(f"segment lengths must be >= 0, got {list(lengths)}")
    return _cached_plan(tuple(int(n) for n in lengths), heads_kv, matmul_max_length, torch.device(device))


def _sdpa_view(plan: BucketPlan, rows: torch.Tensor, i: int, heads: int) -> torch.Tensor:
    """Sdpa bucket ``i``'s rows (token-major ``[count * length * H_kv, F']``) as ``[count, h, length, D]``.

    A view: the sdpa inputs and output gradients cross the autograd functions in sdpa's layout, so the
    per-bucket reshapes are not recorded (one autograd node per bucket: the sdpa call).
    """
    count, length = plan.shapes[i]
    return rows.view(count, length, heads, -1).transpose(1, 2)


def _put_sdpa(rows: torch.Tensor, part: torch.Tensor) -> None:
    """Write ``part`` ``[count, h, length, D]`` (sdpa's layout) into a bucket's token-major ``rows``."""
    count, heads, length = part.shape[:3]
    rows.view(count, length, heads, -1).copy_(part.transpose(1, 2))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[1, H, N, D]`` -> ``[N, H * D]`` (free for HF's layout, a transposed ``[1, N, H, D]``)."""
    return x.transpose(1, 2).reshape(x.shape[2], -1)


def _units(x: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """Rows ``[N, F]`` as ``[N * H_kv, F / H_kv]`` (a view)."""
    return x.view(x.shape[0] * heads_kv, -1)


def _store(target: torch.Tensor, result: torch.Tensor) -> None:
    """Copy a bucket's fp32 result into its slice of a (possibly half-precision) tensor."""
    target.view(result.shape).copy_(result)


class _Buckets(torch.autograd.Function):
    """Gathers q/k/v, runs the matmul buckets and hands out the sdpa buckets' inputs.

    Forward: ``(q [1, H, N, D], k [1, H_kv, N, D], v [1, H_kv, N, D_v])`` -> ``(out [N * H_kv, F'],
    out_gathered [G, F'], *q_parts, *k_parts, *v_parts)`` with ``F' = H * D_v / H_kv``: the matmul
    buckets' output rows, in place or gathered (:class:`BucketPlan`; the sdpa buckets' rows are written by
    :class:`_PutRows`); the parts are the sdpa buckets' inputs in sdpa's layout (views), q ``[count, H,
    length, D]``, k and v ``[count, H_kv, length, D]``.
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
        ctx.set_materialize_grads(False)
        ctx.shapes = (query.shape, key.shape, value.shape)
        heads_kv = plan.heads_kv
        group = heads // heads_kv
        rows = [_units(_rows(x), heads_kv) for x in (query, key, value)]
        gathered = [plan.gathered(x) for x in rows]
        q, k, v = (functools.partial(plan.part, x, g) for x, g in zip(rows, gathered))
        out = rows[0].new_empty(rows[0].shape[0], group * rows[2].shape[1])
        out_gathered = out.new_empty(gathered[0].shape[0], out.shape[1])
        fp32 = out.dtype == torch.float32
        probs_of = []
        for i, (count, length) in enumerate(plan.shapes):
            if not plan.matmul[i]:
                continue
            batch = count * heads_kv
            qb = q(i).view(batch, length * group, -1).float()  # half precision: in fp32
            kb, vb = (x(i).view(batch, length, -1).float() for x in (k, v))
            mask = additive_mask(length, group, is_causal, window, query.device)
            probs = _softmax_(torch.baddbmm(mask, qb, kb.transpose(1, 2), alpha=scale))
            target = plan.part(out, out_gathered, i)
            if fp32:
                torch.bmm(probs, vb, out=target.view(batch, length * group, -1))
            else:
                _store(target, torch.bmm(probs, vb))
            probs_of.append(probs)
        ctx.save_for_backward(*rows, *gathered, *probs_of)
        ctx.plan, ctx.scale, ctx.group = plan, scale, group
        sources = zip((q, k, v), (heads, heads_kv, heads_kv))
        return out, out_gathered, *(_sdpa_view(plan, x(i), i, h) for x, h in sources for i in plan.sdpa)

    @staticmethod
    def backward(
        ctx: FunctionCtx, grad_out: torch.Tensor | None, grad_gathered: torch.Tensor,
        *grad_parts: torch.Tensor,
    ) -> tuple[torch.Tensor | None, ...]:
        plan: BucketPlan = ctx.plan
        saved = ctx.saved_tensors
        rows, gathered, probs_of = saved[:3], saved[3:6], saved[6:]
        q, k, v = (functools.partial(plan.part, x, g) for x, g in zip(rows, gathered))
        dout = functools.partial(plan.part, grad_out, grad_gathered)
        grads = [torch.empty_like(x) for x in rows]
        grads_gathered = [torch.empty_like(x) for x in gathered]
        fp32 = rows[0].dtype == torch.float32
        probs_iter = iter(probs_of)
        for i, (count, length) in enumerate(plan.shapes):
            if not plan.matmul[i]:
                continue
            probs = next(probs_iter)
            batch = count * plan.heads_kv
            qb = q(i).view(batch, length * ctx.group, -1).float()
            kb, vb = (x(i).view(batch, length, -1).float() for x in (k, v))
            dob = dout(i).view(batch, length * ctx.group, -1).float()
            targets = [plan.part(g, gg, i) for g, gg in zip(grads, grads_gathered)]
            if fp32:
                shaped = [t.view(x.shape) for t, x in zip(targets, (qb, kb, vb))]
                matmul_attention_backward(dob, qb, kb, vb, probs, ctx.scale, out=shaped)
            else:
                for t, dx in zip(targets, matmul_attention_backward(dob, qb, kb, vb, probs, ctx.scale)):
                    _store(t, dx)
        parts = iter(grad_parts)
        for g, gg in zip(grads, grads_gathered):
            for i in plan.sdpa:
                _put_sdpa(plan.part(g, gg, i), next(parts))
        n = ctx.shapes[0][2]
        as_inputs = (plan.scatter(g, gg).view(1, n, h, d).transpose(1, 2)
                     for g, gg, (_, h, _, d) in zip(grads, grads_gathered, ctx.shapes))
        return *as_inputs, None, None, None, None, None


class _PutRows(torch.autograd.Function):
    """Writes the sdpa buckets' outputs next to the matmul buckets' and puts the gathered rows back.

    Forward: ``(plan, out [N * H_kv, F'], out_gathered [G, F'], *outs)`` with ``outs`` the sdpa outputs
    ``[count, H, length, D_v]`` -> ``(packed-row out [N * H_kv, F'], out_gathered)`` (the second only
    because it was written in place); the backward hands the sdpa outputs' gradients back in their layout.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx, plan: BucketPlan, out: torch.Tensor, out_gathered: torch.Tensor,
        *parts: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        ctx.plan = plan
        ctx.heads = [part.shape[1] for part in parts]
        for i, part in zip(plan.sdpa, parts):
            _put_sdpa(plan.part(out, out_gathered, i), part)
        ctx.mark_dirty(*((out_gathered,) if plan.inverse is not None else (out, out_gathered)))
        return plan.scatter(out, out_gathered), out_gathered  # every row gathered: `out` untouched

    @staticmethod
    def backward(
        ctx: FunctionCtx, grad: torch.Tensor, _: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        plan: BucketPlan = ctx.plan
        grad = grad.contiguous()
        grad_gathered = plan.gathered(grad)
        parts = (_sdpa_view(plan, plan.part(grad, grad_gathered, i), i, h)
                 for i, h in zip(plan.sdpa, ctx.heads))
        # `out`'s gradient: `grad` itself; _Buckets reads only its in-place rows (the gathered rows were
        # overwritten by the scatter, their gradient is `grad_gathered`)
        return None, None if plan.inverse is not None else grad, grad_gathered, *parts


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
    out, out_gathered, *parts = _Buckets.apply(query, key, value, plan, heads, scale, is_causal, window)
    n_sdpa = len(plan.sdpa)
    outs = []
    qs, ks, vs = parts[:n_sdpa], parts[n_sdpa : 2 * n_sdpa], parts[2 * n_sdpa :]
    for i, q, k, v in zip(plan.sdpa, qs, ks, vs):  # q [count, H, length, D], k, v [count, H_kv, length, D]
        mask = None if window is None else sliding_window_mask(plan.shapes[i][1], window, query.device)
        outs.append(F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal and mask is None, scale=scale,
            enable_gqa=heads != heads_kv,
        ))  # [count, H, length, D_v], laid out as [count, length, H, D_v]
    out, _ = _PutRows.apply(plan, out, out_gathered, *outs)
    return out.view(1, n, heads, dim_v)
