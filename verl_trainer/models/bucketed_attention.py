"""Packed (varlen) attention without a Python loop per segment: segments bucketed by length.

Where no fused varlen kernel exists (CPU; CUDA in fp32 or without one), the segments of a packed row are
sorted by length and grouped into a few buckets; each bucket is one batched ``scaled_dot_product_attention``
call over its segments, right-padded to the bucket's longest segment. With right padding, causal attention
needs no extra mask: a real query ``i`` only reads keys ``<= i``, which are real tokens of its own segment.
The padded query rows compute something and are dropped.

The data movement is two row gathers per tensor (packed -> padded buckets -> packed) through
:class:`_RowGather`, whose backward is again a gather (never a scatter-add): every packed token owns
exactly one padded row, and the gradient reaching a padding row is exactly zero (padding queries get a
zero output gradient; no real query attends to a padding key), so dropping it is exact.

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
    """How the segments of a packed row map onto padded buckets.

    Attributes:
        shapes: ``(count, padded_length)`` of each bucket, in the order of the padded rows.
        gather: ``[P]`` long, the packed token read into each padded row (a padding row reads its
            segment's first token; its result is dropped).
        scatter: ``[N]`` long, the padded row of each packed token.
        valid: ``[P]`` bool, True at the padded rows that hold a real token.

    """

    shapes: tuple[tuple[int, int], ...]
    gather: torch.Tensor
    scatter: torch.Tensor
    valid: torch.Tensor


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
    shapes, gathers, valids = [], [], []
    for group in _group(lengths, call_cost):
        idx = torch.tensor(group, dtype=torch.long)
        width = int(lens[idx].max())
        col = torch.arange(width)[None, :]
        real = col < lens[idx][:, None]  # [count, width]
        gathers.append(torch.where(real, starts[idx][:, None] + col, starts[idx][:, None]).reshape(-1))
        valids.append(real.reshape(-1))
        shapes.append((len(group), width))
    total = sum(lengths)
    gather = torch.cat(gathers) if gathers else torch.zeros(0, dtype=torch.long)
    valid = torch.cat(valids) if valids else torch.zeros(0, dtype=torch.bool)
    scatter = torch.empty(total, dtype=torch.long)
    scatter[gather[valid]] = torch.nonzero(valid).reshape(-1)
    return BucketPlan(tuple(shapes), gather.to(device), scatter.to(device), valid.to(device))


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


class _RowGather(torch.autograd.Function):
    """``x[index]`` over rows; its backward is the gather ``grad[back_index]``, zeroed where ``~back_valid``.

    Exact when ``index`` reaches every row of ``x`` once through ``back_index`` and every other row of
    the output receives a zero gradient — what :class:`BucketPlan` guarantees.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        index: torch.Tensor,
        back_index: torch.Tensor,
        back_valid: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(back_index, back_valid)
        return x.index_select(0, index)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        back_index, back_valid = ctx.saved_tensors  # type: ignore[attr-defined]
        out = grad.index_select(0, back_index)
        if back_valid is not None:
            out.masked_fill_(~back_valid[:, None], 0)
        return out, None, None, None


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
    padded = [
        _RowGather.apply(_rows(x), plan.gather, plan.scatter, None) for x in (query, key, value)
    ]  # [P, H * D] each
    sizes = [count * width for count, width in plan.shapes]
    outs = []
    for q, k, v, valid, (count, width) in zip(
        *(p.split(sizes) for p in padded), plan.valid.split(sizes), plan.shapes
    ):
        mask = _bucket_mask(count, width, valid, is_causal, window, query.device)
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
    if not outs:
        return query.new_zeros(1, n, heads, dim_v)
    rows = torch.cat(outs) if len(outs) > 1 else outs[0]
    return _RowGather.apply(rows, plan.scatter, plan.gather, plan.valid).view(1, n, heads, dim_v)
