"""The kernels packed attention can run on: fused varlen kernels on CUDA, and the per-segment reference.

* :func:`fused_varlen_attention`: flash-attn's ``flash_attn_varlen_func`` when flash-attn is installed,
  else PyTorch's ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10; causal is
  ``window_size=(-1, 0)``); both need CUDA tensors in fp16/bf16. Returns ``None`` where neither applies,
  and the caller takes the bucketed path (``verl_trainer.models.bucketed_attention``).
* :func:`reference_varlen_attention`: one sdpa call per segment — the ground truth the tests and
  ``bench/attention.py`` compare against, never the production path.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F  # noqa: N812

_HALF = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=1)
def flash_attn_varlen_func() -> Callable | None:
    """flash-attn's ``flash_attn_varlen_func``, or ``None`` when flash-attn is not installed."""
    try:
        from flash_attn import flash_attn_varlen_func as fn
    except ImportError:
        return None
    return fn


@functools.lru_cache(maxsize=1)
def torch_varlen_attn() -> tuple[Callable, frozenset[str]] | None:
    """PyTorch's ``varlen_attn`` and its keyword names, or ``None`` on a torch without it (< 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def sliding_window_mask(length: int, window: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Causal sliding-window mask ``[length, length]`` (bool); query ``i`` reads ``i - window < j <= i``."""
    pos = torch.arange(length, device=device)
    offset = pos[:, None] - pos[None, :]  # query - key
    return (offset >= 0) & (offset < window)


def _left_window(window: int | None) -> int:
    """Keys a query may read to its left: ``window - 1`` (transformers' convention), ``-1`` = unlimited."""
    return -1 if window is None else window - 1


def fused_varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    scaling: float | None,
    dropout: float,
    is_causal: bool,
    window: int | None,
) -> torch.Tensor | None:
    """Run a fused CUDA varlen kernel if one applies, else return ``None``.

    Args:
        query: ``[1, H, N, D]``.
        key: ``[1, H_kv, N, D]``.
        value: ``[1, H_kv, N, D_v]``.
        cu_seqlens: ``[S + 1]`` offsets.
        max_seqlen: Longest segment.
        scaling: Softmax scale (``None``: ``D ** -0.5``).
        dropout: Attention dropout probability (``varlen_attn`` has none: only flash-attn takes > 0).
        is_causal: Causal attention within each segment.
        window: Sliding window (keys ``i - window < j <= i``) or ``None``.

    Returns:
        ``[1, N, H, D_v]``, or ``None`` when no fused kernel applies (CPU, fp32, no kernel installed).

    """
    if not query.is_cuda or query.dtype not in _HALF:
        return None
    cu = cu_seqlens.to(device=query.device, dtype=torch.int32)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [N, H, D]
    flash = flash_attn_varlen_func()
    if flash is not None:
        out = flash(
            q, k, v, cu, cu, max_seqlen, max_seqlen,
            dropout_p=dropout,
            softmax_scale=scaling,
            causal=is_causal,
            window_size=(_left_window(window), 0 if is_causal else _left_window(window)),
        )
        return out.unsqueeze(0)
    found = torch_varlen_attn()
    if found is None or dropout > 0 or (window is not None and not is_causal):
        return None
    varlen_attn, params = found
    kwargs: dict = {"scale": scaling}
    if "window_size" in params:  # torch >= 2.11: causality and the window are one argument
        kwargs["window_size"] = (_left_window(window), 0) if is_causal else (-1, -1)
    elif window is not None:
        return None
    else:
        kwargs["is_causal"] = is_causal
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)
    return out.unsqueeze(0)


def reference_varlen_attention(
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
    """One sdpa call per segment (inputs split with ``torch.split``): the reference, O(S) Python calls.

    Args:
        query: ``[1, H, N, D]``.
        key: ``[1, H_kv, N, D]``.
        value: ``[1, H_kv, N, D_v]``.
        lengths: The ``S`` segment lengths (zeros allowed).
        scaling: Softmax scale.
        dropout: Attention dropout probability.
        is_causal: Causal attention within each segment.
        window: Sliding window (keys ``i - window < j <= i``, causal) or ``None``.

    Returns:
        ``[1, N, H, D_v]``.

    """
    lengths = [int(n) for n in lengths]
    gqa = query.shape[1] != key.shape[1]
    outs = []
    for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2)):
        if q.shape[2] == 0:
            outs.append(q.new_zeros(*q.shape[:3], value.shape[3]))
            continue
        mask = None if window is None else sliding_window_mask(q.shape[2], window, q.device)
        outs.append(
            F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal and mask is None,
                scale=scaling, enable_gqa=gqa,
            )
        )
    out = torch.cat(outs, 2) if len(outs) > 1 else outs[0]  # [1, H, N, D_v]
    return out.transpose(1, 2)
