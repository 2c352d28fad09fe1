"""Padding-free (varlen) attention for HF models, registered through transformers' attention interface.

The engine packs a micro-batch into one row ``[1, N]`` (``verl_trainer.data.packing``). The linear
layers run on the packed row; attention must not cross samples. With transformers 5.24 + sdpa,
restarting position ids alone do NOT isolate the samples (the model builds a cache by default, which
disables transformers' packed-sequence detection, and any 2-D attention mask does too), and a 4-D
block-diagonal mask costs O(N^2) memory. So attention runs per sample over ``cu_seqlens``:

* ``flash_attn_varlen_func`` when flash-attn is installed and the tensors are CUDA fp16/bf16;
* otherwise causal ``scaled_dot_product_attention`` per segment (O(sum L_i^2) compute, no O(N^2) mask).

How ``cu_seqlens`` reach the attention function: transformers forwards every extra keyword of
``model(...)`` down to the attention function (``FlashAttentionKwargs``: ``cu_seq_lens_q``,
``cu_seq_lens_k``, ``max_length_q``, ``max_length_k``), next to ``position_ids``.
:func:`varlen_model_kwargs` builds them; :func:`packed_forward` passes them. Without them the
function derives the segments from ``position_ids`` (a new segment wherever the position does not go
up by one), and with a padding mask or a KV cache (``generate``) it is plain sdpa — so a model
switched to ``"verl_varlen"`` still works for ordinary padded forwards and generation.

The attention function is registered together with a mask function (``AttentionMaskInterface``) that
returns ``None`` whenever no padding or cache is involved, so transformers never builds an O(N^2) mask
for a packed row.

Ulysses SP wraps :func:`varlen_attention` (all-to-all before and after) and registers its wrapper
with :func:`register_varlen_attention`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from verl_trainer.data.packing import PackedBatch

VARLEN_ATTENTION = "verl_varlen"
"""Name of the padding-free attention implementation (``config._attn_implementation``)."""

_VARLEN_NAMES: set[str] = set()


@functools.lru_cache(maxsize=1)
def _flash_attn_varlen_func() -> Callable | None:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Segment offsets of a packed row: a new segment starts wherever the position does not go up by 1.

    Args:
        position_ids: ``[1, N]`` or ``[N]``.

    Returns:
        ``[S + 1]`` int32 offsets.

    """
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos[1:] - pos[:-1] != 1).reshape(-1) + 1
    edges = [starts.new_zeros(1), starts, starts.new_full((1,), pos.numel())]
    return torch.cat(edges).to(torch.int32)


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    is_causal: bool = True,
) -> torch.Tensor:
    """Attention within each segment of a packed row.

    Args:
        query: ``[1, H, N, D]``.
        key: ``[1, H_kv, N, D]``; ``H`` must be a multiple of ``H_kv`` (GQA / MQA).
        value: ``[1, H_kv, N, D_v]``.
        cu_seqlens: ``[S + 1]`` offsets of the segments (``cu_seqlens[-1] == N``).
        max_seqlen: Longest segment (computed when ``None``; flash-attn needs it).
        scaling: Softmax scale (default ``D ** -0.5``).
        dropout: Attention dropout probability.
        is_causal: Causal attention within each segment.

    Returns:
        ``[1, N, H, D_v]`` (the layout transformers' attention functions return).

    """
    if query.shape[0] != 1:
        raise ValueError(f"varlen attention expects one packed row, got batch size {query.shape[0]}")
    n, num_heads, num_kv = query.shape[2], query.shape[1], key.shape[1]
    if int(cu_seqlens[-1]) != n:
        raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])} but the packed row holds {n} tokens")
    if num_heads % num_kv:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of key/value heads ({num_kv})")
    flash = _flash_attn_varlen_func()
    if flash is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
        cu = cu_seqlens.to(device=query.device, dtype=torch.int32)
        if max_seqlen is None:
            max_seqlen = int((cu[1:] - cu[:-1]).max())
        out = flash(
            query[0].transpose(0, 1),
            key[0].transpose(0, 1),
            value[0].transpose(0, 1),
            cu,
            cu,
            max_seqlen,
            max_seqlen,
            dropout_p=dropout,
            softmax_scale=scaling,
            causal=is_causal,
        )
        return out.unsqueeze(0)  # [N, H, D] -> [1, N, H, D]
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    lens = [length for length in lens if length > 0]
    gqa = num_heads != num_kv
    outs = []
    for q, k, v in zip(query.split(lens, 2), key.split(lens, 2), value.split(lens, 2)):
        outs.append(
            F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, is_causal=is_causal, scale=scaling, enable_gqa=gqa
            )
        )
    out = torch.cat(outs, 2) if len(outs) > 1 else outs[0]  # [1, H, N, D]
    return out.transpose(1, 2).contiguous()


def _check_sliding_window(sliding_window: int | None, longest: int) -> None:
    if sliding_window is not None and sliding_window < longest:
        raise NotImplementedError(
            f"sliding-window attention (window {sliding_window}) over sequences of {longest} tokens is not "
            f"supported by {VARLEN_ATTENTION!r}; use shorter sequences or another attn_implementation"
        )


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attend within the packed segments; registered as ``"verl_varlen"`` in ``AttentionInterface``.

    Args:
        module: The attention module (its ``is_causal`` is honoured).
        query: ``[B, H, Tq, D]``.
        key: ``[B, H_kv, Tk, D]``.
        value: ``[B, H_kv, Tk, D]``.
        attention_mask: A 4-D mask (padding / cache / a reference block mask) or ``None``.
        dropout: Attention dropout probability (transformers passes 0 in eval mode).
        scaling: Softmax scale.
        sliding_window: Sliding window of the layer, if any.
        **kwargs: ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (``[S + 1]``), ``max_length_q`` /
            ``max_length_k`` (int), ``position_ids`` ``[B, Tq]``, and whatever else the model forwards.

    Returns:
        ``([B, Tq, H, D], None)``.

    """
    cu = kwargs.get("cu_seq_lens_q")
    n = query.shape[2]
    packed_row = attention_mask is None and query.shape[0] == 1 and key.shape[2] == n and n > 1
    if cu is None and packed_row and kwargs.get("position_ids") is not None:
        cu = cu_seqlens_from_position_ids(kwargs["position_ids"])
        if cu.numel() <= 2:  # a single sequence: plain causal attention
            cu = None
    if cu is None or not packed_row:
        if attention_mask is None:  # with a mask, sdpa_mask has built the window into it
            _check_sliding_window(sliding_window, key.shape[2])
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    cu_k = kwargs.get("cu_seq_lens_k")
    if cu_k is not None and cu_k is not cu and not torch.equal(cu_k.to(cu.device), cu):
        raise NotImplementedError("varlen attention with different query and key segments is not supported")
    max_seqlen = kwargs.get("max_length_q")
    if max_seqlen is None:
        max_seqlen = int((cu[1:] - cu[:-1]).max())
    _check_sliding_window(sliding_window, max_seqlen)
    out = varlen_attention(
        query,
        key,
        value,
        cu,
        max_seqlen,
        scaling=scaling,
        dropout=dropout,
        is_causal=getattr(module, "is_causal", True),
    )
    return out, None


def varlen_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """Mask function registered with ``AttentionMaskInterface`` next to the varlen attention.

    Returns ``None`` (no mask; the attention function handles causality and segments) when there is no
    padding, no cache offset and no sliding window shorter than the row — in particular for a packed
    row, so no O(N^2) mask is built. Otherwise (padded batches, generation with a cache, a sliding-window
    layer over a longer row) it builds sdpa's 4-D mask, which includes the packed segments, and the
    attention function runs plain sdpa with it: correct, but O(N^2).
    """
    no_padding = attention_mask is None or (
        attention_mask.shape[-1] == kv_length and bool(attention_mask.all())
    )
    no_offset = isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == 0 and kv_offset == 0
    no_window = local_size is None or local_size >= kv_length
    if no_padding and no_offset and no_window and q_length == kv_length:
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        local_size=local_size,
        **kwargs,
    )


def register_varlen_attention(name: str, fn: Callable[..., tuple[torch.Tensor, None]]) -> None:
    """Register a varlen attention function (and the matching mask function) under ``name``.

    Use it for wrappers of :func:`varlen_attention_forward` (e.g. Ulysses SP: all-to-all, call, all-to-all).
    """
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, varlen_attention_mask)
    _VARLEN_NAMES.add(name)


register_varlen_attention(VARLEN_ATTENTION, varlen_attention_forward)


def _config_of(model: torch.nn.Module) -> Any:
    """Return the HF config of a model, looking through wrappers that keep the model in ``.module``."""
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    return getattr(model, "config", None)


def ensure_varlen_attention(model: torch.nn.Module, name: str = VARLEN_ATTENTION) -> torch.nn.Module:
    """Switch a loaded HF model to the varlen attention implementation (in place) and return it."""
    if name not in _VARLEN_NAMES:
        registered = sorted(_VARLEN_NAMES)
        raise ValueError(f"{name!r} is not a registered varlen attention; registered: {registered}")
    inner = model
    while not hasattr(inner, "set_attn_implementation") and hasattr(inner, "module"):
        inner = inner.module
    if not hasattr(inner, "set_attn_implementation"):
        raise TypeError(f"{type(model).__name__} is not a transformers PreTrainedModel")
    inner.set_attn_implementation(name)
    return model


def varlen_model_kwargs(cu_seqlens: torch.Tensor, max_seqlen: int | None = None) -> dict[str, Any]:
    """Build the forward keywords that carry the segments to the attention function.

    Args:
        cu_seqlens: ``[B + 1]`` offsets of the packed row (the *full* row, also under SP).
        max_seqlen: Longest segment (computed when ``None``).

    Returns:
        ``{"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}``.

    """
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
    return {
        "cu_seq_lens_q": cu_seqlens,
        "cu_seq_lens_k": cu_seqlens,
        "max_length_q": max_seqlen,
        "max_length_k": max_seqlen,
    }


def packed_forward(model: torch.nn.Module, packed: PackedBatch, **kwargs: Any) -> Any:
    """Run an HF model on a packed row with padding-free attention.

    Args:
        model: An HF model switched to varlen attention (:func:`ensure_varlen_attention`), possibly
            wrapped (FSDP2 keeps the class; wrappers with ``.module`` are looked through for the config).
        packed: The packed micro-batch.
        **kwargs: Extra forward keywords (e.g. ``logits_to_keep``).

    Returns:
        The model output: ``logits [1, N, V]`` for a causal LM, ``[1, N, 1]`` for the value model.

    """
    config = _config_of(model)
    impl = getattr(config, "_attn_implementation", None)
    if config is not None and impl not in _VARLEN_NAMES:
        raise ValueError(
            f"the model uses attn_implementation={impl!r}, which attends across the packed samples; "
            f"call ensure_varlen_attention(model) first (registered: {sorted(_VARLEN_NAMES)})"
        )
    return model(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        attention_mask=None,
        use_cache=False,
        **varlen_model_kwargs(packed.cu_seqlens, packed.max_seqlen),
        **kwargs,
    )


def block_diagonal_causal_mask(cu_seqlens: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive 4-D mask for a packed row: causal within each segment, -inf across. O(N^2): tests only.

    Args:
        cu_seqlens: ``[B + 1]`` offsets.
        dtype: Float dtype of the mask (the model's).

    Returns:
        ``[1, 1, N, N]`` with 0 where attention is allowed and ``finfo(dtype).min`` elsewhere.

    """
    n = int(cu_seqlens[-1])
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.long)
    seg = torch.repeat_interleave(torch.arange(lens.numel(), device=cu_seqlens.device), lens, output_size=n)
    idx = torch.arange(n, device=cu_seqlens.device)
    allowed = (seg[:, None] == seg[None, :]) & (idx[:, None] >= idx[None, :])
    mask = torch.zeros(n, n, dtype=dtype, device=cu_seqlens.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def reference_packed_forward(model: torch.nn.Module, packed: PackedBatch, **kwargs: Any) -> Any:
    """Run the O(N^2) reference: the packed row with a 4-D block-diagonal causal mask (any attn impl)."""
    dtype = next(model.parameters()).dtype
    return model(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        attention_mask=block_diagonal_causal_mask(packed.cu_seqlens, dtype),
        use_cache=False,
        **kwargs,
    )
