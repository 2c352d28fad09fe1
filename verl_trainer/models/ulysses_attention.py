"""Ulysses sequence-parallel attention for HF models, registered through transformers' attention interface.

No model file is copied or patched: the attention function below is registered (next to the varlen mask
function) as ``"verl_ulysses"``, and a model loaded with ``attn_implementation="verl_ulysses"`` (or
switched with ``ensure_varlen_attention(model, ULYSSES_ATTENTION)``) calls it from every attention layer
of the Qwen2, Llama and other families that dispatch through ``ALL_ATTENTION_FUNCTIONS``.

Each SP rank runs the model on its ``N/sp`` tokens of a packed row. The projections and the rotary
embedding are per-token, so they run locally; in every attention layer the function

1. repeats the key/value heads when their number is not a multiple of ``sp`` (GQA groups are kept:
   query head ``h`` still reads the copy of its own key/value head);
2. all-to-all: ``[1, H, N/sp, D] -> [1, H/sp, N, D]``
   (:func:`~verl_trainer.models.ulysses.gather_seq_scatter_heads`);
3. runs :func:`~verl_trainer.models.attention.varlen_attention_forward` over the FULL row's segments —
   ``cu_seq_lens_q`` of the whole (padded) row, or, when the caller did not pass it, the segments derived
   from the position ids all-gathered over the SP group — so attention stays within each sample;
4. all-to-all back: ``[1, N, H/sp, D] -> [1, N/sp, H, D]``.

The SP group comes from the ``ulysses_sp_group`` forward keyword when given (transformers forwards extra
keywords down to the attention function, also when activation checkpointing recomputes a layer), else
from :func:`~verl_trainer.models.ulysses.get_ulysses_sequence_parallel_group`. Without a group, or with an SP
size of 1, this is exactly ``"verl_varlen"``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from verl_trainer.models.attention import (
    cu_seqlens_from_position_ids,
    register_varlen_attention,
    varlen_attention_forward,
)
from verl_trainer.models.ulysses import (
    all_gather_tensor,
    gather_heads_scatter_seq,
    gather_seq_scatter_heads,
    get_ulysses_sequence_parallel_group,
    get_ulysses_sequence_parallel_world_size,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ULYSSES_ATTENTION = "verl_ulysses"
"""Name of the Ulysses attention implementation (``config._attn_implementation``)."""

SP_GROUP_KWARG = "ulysses_sp_group"
"""Forward keyword that carries the SP process group down to the attention function."""


def check_ulysses_compatible(config: PretrainedConfig, sp_size: int, world_size: int | None = None) -> None:
    """Raise a clear ``ValueError`` when a model cannot run with Ulysses SP of size ``sp_size``.

    Args:
        config: HF model config (``num_attention_heads``, ``num_key_value_heads``).
        sp_size: Requested ``ulysses_sequence_parallel_size``.
        world_size: Number of ranks, checked to be a multiple of ``sp_size`` when given.

    Raises:
        ValueError: ``sp_size < 1``; ``world_size % sp_size != 0``; ``num_attention_heads % sp_size != 0``.

    """
    if sp_size < 1:
        raise ValueError(f"ulysses_sequence_parallel_size must be >= 1, got {sp_size}")
    if world_size is not None and world_size % sp_size:
        raise ValueError(
            f"ulysses_sequence_parallel_size={sp_size} does not divide the world size {world_size}; "
            f"choose a divisor of {world_size}"
        )
    heads = getattr(config, "num_attention_heads", None)
    if heads is not None and heads % sp_size:
        valid = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(
            f"num_attention_heads={heads} is not divisible by ulysses_sequence_parallel_size={sp_size}; "
            f"Ulysses gives every SP rank heads/sp query heads, so choose sp in {valid}"
        )


def repeat_kv_for_sp(
    key: torch.Tensor, value: torch.Tensor, sp_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Repeat key/value heads (each head ``r`` times in place) until their number divides by ``sp_size``.

    With ``H_kv' = lcm(H_kv, sp)`` heads, query head ``h`` of ``H`` still maps to a copy of its own
    key/value head (``h // (H / H_kv')`` is a copy of ``h // (H / H_kv)``), also after the heads are
    split into ``sp`` contiguous groups.

    Args:
        key: ``[B, H_kv, T, D]``.
        value: ``[B, H_kv, T, D_v]``.
        sp_size: SP size.

    Returns:
        ``(key, value)`` with ``lcm(H_kv, sp)`` heads (unchanged when ``H_kv % sp == 0``).

    """
    num_kv = key.shape[1]
    repeats = math.lcm(num_kv, sp_size) // num_kv
    if repeats == 1:
        return key, value
    return key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)


def _full_row_cu_seqlens(
    kwargs: dict[str, Any], total: int, group: dist.ProcessGroup
) -> tuple[torch.Tensor, int]:
    """Segments of the whole (gathered) row: ``cu_seq_lens_q`` if given, else from gathered position ids."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            raise ValueError(
                f"{ULYSSES_ATTENTION!r} needs the packed row's segments: pass cu_seq_lens_q (the full row's "
                "cu_seqlens) or position_ids to the model forward"
            )
        full_pos = all_gather_tensor(position_ids.reshape(1, -1), gather_dim=1, group=group)
        cu = cu_seqlens_from_position_ids(full_pos)
    end = int(cu[-1])
    if end > total:
        raise ValueError(
            f"cu_seq_lens_q ends at {end} but the SP group holds {total} tokens in all; pass the cu_seqlens "
            "of the whole padded row (verl_trainer.models.ulysses_forward.ulysses_slice_packed)"
        )
    max_seqlen = kwargs.get("max_length_q")
    if end < total:  # the padding added by ulysses_pad is one more segment
        cu = torch.cat([cu, cu.new_full((1,), total)])
        max_seqlen = None
    if max_seqlen is None:
        max_seqlen = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    return cu, int(max_seqlen)


def ulysses_attention_forward(
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
    """Ulysses attention over the local slice of a packed row; registered as ``"verl_ulysses"``.

    Args:
        module: The attention module.
        query: ``[1, H, N/sp, D]`` (this rank's tokens, all heads).
        key: ``[1, H_kv, N/sp, D]``.
        value: ``[1, H_kv, N/sp, D_v]``.
        attention_mask: Must be ``None`` when ``sp > 1`` (a packed row has no padding mask or cache).
        dropout: Attention dropout probability.
        scaling: Softmax scale.
        sliding_window: Sliding window of the layer, if any.
        **kwargs: ``ulysses_sp_group`` (the SP group), ``cu_seq_lens_q`` / ``cu_seq_lens_k`` of the
            FULL row, ``max_length_q`` / ``max_length_k``, ``position_ids`` ``[1, N/sp]``, ...

    Returns:
        ``([1, N/sp, H, D_v], None)``.

    Raises:
        ValueError: ``H % sp != 0``, or no segment information.
        NotImplementedError: A padding mask / KV cache, or a batch of more than one row, with ``sp > 1``.

    """
    group = kwargs.pop(SP_GROUP_KWARG, None)
    group = get_ulysses_sequence_parallel_group() if group is None else group
    sp = get_ulysses_sequence_parallel_world_size(group)
    if sp == 1:
        return varlen_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, sliding_window, **kwargs
        )
    if attention_mask is not None or query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        raise NotImplementedError(
            f"{ULYSSES_ATTENTION!r} with sequence-parallel size {sp} runs on one packed row sliced over the "
            f"SP group (no attention mask, no KV cache); got query {tuple(query.shape)}, key "
            f"{tuple(key.shape)}, attention_mask {'set' if attention_mask is not None else None}. "
            "Use verl_trainer.models.ulysses_forward, or a model with 'verl_varlen' for generation"
        )
    num_heads = query.shape[1]
    if num_heads % sp:
        raise ValueError(
            f"num_attention_heads={num_heads} is not divisible by ulysses_sequence_parallel_size={sp}"
        )
    key, value = repeat_kv_for_sp(key, value, sp)
    total = query.shape[2] * sp
    cu, max_seqlen = _full_row_cu_seqlens(kwargs, total, group)
    for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(name, None)
    q = gather_seq_scatter_heads(query, seq_dim=2, head_dim=1, group=group)  # [1, H/sp, N, D]
    k = gather_seq_scatter_heads(key, seq_dim=2, head_dim=1, group=group)
    v = gather_seq_scatter_heads(value, seq_dim=2, head_dim=1, group=group)
    out, _ = varlen_attention_forward(
        module,
        q,
        k,
        v,
        None,
        dropout,
        scaling,
        sliding_window,
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=max_seqlen,
        max_length_k=max_seqlen,
    )  # [1, N, H/sp, D]
    return gather_heads_scatter_seq(out, head_dim=2, seq_dim=1, group=group), None  # [1, N/sp, H, D]


register_varlen_attention(ULYSSES_ATTENTION, ulysses_attention_forward)
