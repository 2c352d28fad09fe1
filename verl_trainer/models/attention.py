"""Padding-free (varlen) attention for HF models, registered through transformers' attention interface.

The engine packs a micro-batch into one row ``[1, N]`` (``verl_trainer.data.packing``); the linear layers
run on the packed row and :func:`varlen_attention` runs attention within the segments given by
``cu_seqlens``, without a Python loop over samples and without an O(N^2) mask:

* CUDA fp16/bf16: ``flash_attn_varlen_func`` when flash-attn is installed, else PyTorch's ``varlen_attn``
  (``verl_trainer.models.varlen_kernels``);
* otherwise (CPU, fp32): one call per segment length (``verl_trainer.models.bucketed_attention``).

Sliding-window layers run their window inside the same paths.

How the segments arrive: :func:`varlen_model_kwargs` builds transformers' ``FlashAttentionKwargs``
(``cu_seq_lens_q`` / ``_k``, ``max_length_q`` / ``_k``), which ``model(...)`` forwards to the attention
function; :func:`packed_forward` passes them. Without them the segments are derived from ``position_ids``
(a new segment wherever the position does not go up by one), and with a padding mask or a KV cache
(``generate``) the function is plain sdpa, so a model switched to ``"verl_varlen"`` still runs ordinary
padded forwards and generation. The mask function registered with it returns ``None`` whenever no padding
or cache is involved, so transformers never builds a mask for a packed row.

Ulysses SP wraps :func:`varlen_attention` and registers its wrapper with :func:`register_varlen_attention`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from verl_trainer.data.packing import PackedBatch
from verl_trainer.models.bucketed_attention import bucketed_varlen_attention
from verl_trainer.models.varlen_kernels import fused_varlen_attention

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from transformers.utils import ModelOutput

VARLEN_ATTENTION = "verl_varlen"
"""Name of the padding-free attention implementation (``config._attn_implementation``)."""

_VARLEN_NAMES: set[str] = set()


class ForwardModel(Protocol):
    """What the packed and Ulysses forwards call: an HF model, or a wrapper that calls one.

    The HF config is read from its ``config``, looking through wrappers that keep the model in ``module``.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> ModelOutput:
        """Run the model; the HF output (``logits`` among its fields)."""


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


# Why not the model's own masking: restarting position ids alone do not isolate the samples of a packed
# row (the model builds a cache by default, which disables transformers' packed-sequence detection, and
# any 2-D attention mask does too), and a 4-D block-diagonal mask costs O(N^2) memory.
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
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention within each segment of a packed row, through the fastest path that applies.

    CUDA fp16/bf16: flash-attn's varlen kernel when installed, else ``torch.nn.attention.varlen.varlen_attn``
    (``verl_trainer.models.varlen_kernels``); otherwise (CPU, fp32) segments of similar length are batched
    into one sdpa call per bucket (``verl_trainer.models.bucketed_attention``). All equal
    ``reference_varlen_attention`` (one sdpa call per segment) to round-off.

    Args:
        query: ``[1, H, N, D]``.
        key: ``[1, H_kv, N, D]``; ``H`` must be a multiple of ``H_kv`` (GQA / MQA).
        value: ``[1, H_kv, N, D_v]``.
        cu_seqlens: ``[S + 1]`` offsets of the segments (``cu_seqlens[-1] == N``).
        max_seqlen: Longest segment (computed when ``None``; the fused kernels need it).
        scaling: Softmax scale (default ``D ** -0.5``).
        dropout: Attention dropout probability.
        is_causal: Causal attention within each segment.
        sliding_window: Sliding window of the layer (query ``i`` reads keys ``i - W < j <= i``, causal
            only), or ``None``.

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
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
    window = sliding_window if sliding_window is not None and sliding_window < max_seqlen else None
    if query.is_cuda:  # the fused kernels are CUDA-only; elsewhere the bucketed path, without a call
        out = fused_varlen_attention(
            query, key, value, cu_seqlens, max_seqlen,
            scaling=scaling, dropout=dropout, is_causal=is_causal, window=window,
        )
        if out is not None:
            return out
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    return bucketed_varlen_attention(
        query, key, value, lengths, scaling=scaling, dropout=dropout, is_causal=is_causal, window=window
    )


def _check_sliding_window(sliding_window: int | None, longest: int) -> None:
    if sliding_window is not None and sliding_window < longest:
        raise NotImplementedError(
            f"sliding-window attention (window {sliding_window}) over a batch of several unpadded rows of "
            f"{longest} tokens is not supported by {VARLEN_ATTENTION!r}; pass an attention_mask, or pack the "
            "rows into one (verl_trainer.data.packing.pack_batch)"
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
    n = query.shape[2]
    packed_row = attention_mask is None and query.shape[0] == 1 and key.shape[2] == n and n > 1
    if not packed_row:
        if attention_mask is None:  # with a mask, sdpa_mask has built the window into it
            _check_sliding_window(sliding_window, key.shape[2])
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None and kwargs.get("position_ids") is not None:
        cu = cu_seqlens_from_position_ids(kwargs["position_ids"])
    if cu is None or cu.numel() <= 2:  # a single sequence
        if sliding_window is None or sliding_window >= n:
            return sdpa_attention_forward(
                module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs
            )
        cu = torch.tensor([0, n], dtype=torch.int32, device=query.device)
    cu_k = kwargs.get("cu_seq_lens_k")
    if cu_k is not None and cu_k is not cu and not torch.equal(cu_k.to(cu.device), cu):
        raise NotImplementedError("varlen attention with different query and key segments is not supported")
    out = varlen_attention(
        query,
        key,
        value,
        cu,
        kwargs.get("max_length_q"),
        scaling=scaling,
        dropout=dropout,
        is_causal=getattr(module, "is_causal", True),
        sliding_window=sliding_window,
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
    # one row: the attention function runs the window itself (per segment, no O(N^2) mask)
    no_window = local_size is None or local_size >= kv_length or batch_size == 1
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


def _config_of(model: ForwardModel) -> PretrainedConfig | None:
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
    if getattr(getattr(inner, "config", None), "vision_config", None) is not None:  # models/vlm.py
        inner.set_attn_implementation({"text_config": name, "vision_config": "sdpa"})
        inner.config._attn_implementation = name
    else:
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


def packed_forward(model: ForwardModel, packed: PackedBatch, **kwargs: Any) -> ModelOutput:
    """Run an HF model on a packed row with padding-free attention.

    Args:
        model: An HF model switched to varlen attention (:func:`ensure_varlen_attention`), possibly
            wrapped (FSDP2 keeps the class; wrappers with ``.module`` are looked through for the config).
        packed: The packed micro-batch.
        **kwargs: Extra forward keywords (e.g. ``logits_to_keep``).

    A vision-language row also passes its images (:attr:`PackedBatch.vision`) and its ``[4, 1, N]``
    positions (:attr:`PackedBatch.model_position_ids`, ``models/vlm.py``).

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
        position_ids=packed.model_position_ids,
        attention_mask=None,
        use_cache=False,
        **varlen_model_kwargs(packed.cu_seqlens, packed.max_seqlen),
        **(packed.vision or {}),
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


def reference_packed_forward(model: torch.nn.Module, packed: PackedBatch, **kwargs: Any) -> ModelOutput:
    """Run the O(N^2) reference: the packed row with a 4-D block-diagonal causal mask (any attn impl)."""
    dtype = next(model.parameters()).dtype
    return model(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        attention_mask=block_diagonal_causal_mask(packed.cu_seqlens, dtype),
        use_cache=False,
        **kwargs,
    )
