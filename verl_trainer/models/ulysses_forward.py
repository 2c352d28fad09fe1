"""Running an HF model on a packed row with Ulysses sequence parallelism: the entry points for the engine.

Every rank of an SP group holds the same packed micro-batch (``PackedBatch``, ``N`` tokens). Then:

1. :func:`ulysses_slice_packed`: pad the row to a multiple of ``sp`` (padding tokens have id 0 and
   positions ``0, 1, ..``: a segment of their own), and keep this rank's ``N_pad / sp`` tokens of
   ``input_ids``, ``position_ids``, the next-token ``targets`` (read from the WHOLE row, so the last local
   position knows its next token) and any packed fields; ``cu_seqlens`` stays the whole padded row's.
2. :func:`ulysses_model_forward`: the model on the local tokens; attention is ``"verl_ulysses"``
   (``verl_trainer.models.ulysses_attention``), which receives the SP group and the whole row's segments
   as forward keywords.
3. A per-token ``output_fn`` reduces the local outputs BEFORE anything is gathered — log-probs ``[N/sp]``,
   not logits ``[N/sp, V]`` (:func:`next_token_output_fn`, :func:`value_output_fn`).
4. :func:`~verl_trainer.models.ulysses.gather_outputs_and_unpad` gathers ``[N_pad]`` and drops the padding;
   the gradient of the gather is scaled by ``sp`` (``grad_scaler=True``) so that the AVERAGE of the parameter
   gradients over the SP group (what FSDP over the whole world computes) is the true gradient.

:func:`ulysses_packed_outputs` is steps 1-4; :func:`ulysses_packed_log_probs` and
:func:`ulysses_packed_values` add the schema's next-token shift and give the same ``[N]`` outputs as the
plain packed path. With ``sp_group=None`` and no current SP group every function is the plain packed
forward (``sp = 1``), so one code path serves every SP size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed import ProcessGroup

from verl_trainer.data.packing import PackedBatch, shift_to_targets, token_log_probs_and_entropy
from verl_trainer.models.attention import _config_of, varlen_model_kwargs
from verl_trainer.models.ulysses import (
    gather_outputs_and_unpad,
    get_ulysses_sequence_parallel_group,
    get_ulysses_sequence_parallel_rank,
    get_ulysses_sequence_parallel_world_size,
    slice_input_tensor,
    ulysses_pad,
)
from verl_trainer.models.ulysses_attention import SP_GROUP_KWARG, ULYSSES_ATTENTION

if TYPE_CHECKING:
    from transformers.utils import ModelOutput

    from verl_trainer.models.attention import ForwardModel

OutputFn = Callable[["ModelOutput", "UlyssesSlice"], dict[str, torch.Tensor]]
"""``output_fn(hf_output, local_slice) -> {name: [N_pad/sp, ...]}`` per local position."""


@dataclass
class UlyssesSlice:
    """This SP rank's share of a packed row.

    Attributes:
        input_ids: ``[1, n]`` with ``n = N_pad / sp``.
        position_ids: ``[1, n]``.
        targets: ``[1, n]``: the id of the token after each local position in the whole padded row
            (``targets[j] = ids_pad[offset + j + 1]``, wrapping at the end).
        cu_seqlens: ``[S + 1]`` int32 segments of the WHOLE padded row (the padding is the last segment).
        max_seqlen: Longest segment of the whole padded row.
        num_tokens: ``N``, real tokens of the row (before padding).
        pad_size: ``N_pad - N``.
        sp_size: SP size.
        sp_rank: This rank in the SP group.
        group: The SP group (``None`` when ``sp == 1``).
        fields: The packed fields of the ``PackedBatch``, padded with zeros and sliced, ``[1, n, ...]``.

    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    num_tokens: int
    pad_size: int
    sp_size: int
    sp_rank: int
    group: ProcessGroup | None
    fields: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def offset(self) -> int:
        """Position of this rank's first token in the whole padded row."""
        return self.sp_rank * self.input_ids.shape[1]

    def gather(self, x: torch.Tensor, dim: int = 0, grad_scaler: bool = True) -> torch.Tensor:
        """Gather a per-local-token tensor over the SP group and drop the padding (``[n, ..] -> [N, ..]``)."""
        if self.sp_size == 1:
            return x.narrow(dim, 0, self.num_tokens)
        return gather_outputs_and_unpad(
            x, gather_dim=dim, unpad_dim=dim, padding_size=self.pad_size, grad_scaler=grad_scaler,
            group=self.group,
        )


def ulysses_slice_packed(packed: PackedBatch, sp_group: ProcessGroup | None = None) -> UlyssesSlice:
    """Pad a packed row to a multiple of the SP size and keep this rank's contiguous share.

    Args:
        packed: The whole packed micro-batch (identical on every rank of the SP group).
        sp_group: SP group; ``None``: the current one (``get_ulysses_sequence_parallel_group()``).

    Returns:
        The :class:`UlyssesSlice` of this rank.

    """
    group = get_ulysses_sequence_parallel_group() if sp_group is None else sp_group
    sp = get_ulysses_sequence_parallel_world_size(group)
    ids, pos, pad = ulysses_pad(packed.input_ids, packed.position_ids, sp)
    targets = torch.roll(ids, -1, dims=1)
    cu = packed.cu_seqlens
    if pad:
        cu = torch.cat([cu, cu.new_full((1,), packed.num_tokens + pad)])

    def share(x: torch.Tensor) -> torch.Tensor:  # [1, N_pad, ...] -> [1, N_pad / sp, ...]
        return slice_input_tensor(x, dim=1, padding=False, group=group) if sp > 1 else x

    def pad_and_share(x: torch.Tensor) -> torch.Tensor:  # a packed field [1, N, ...]
        if pad:
            x = torch.cat([x, x.new_zeros((x.shape[0], pad, *x.shape[2:]))], 1)
        return share(x)

    return UlyssesSlice(
        input_ids=share(ids),
        position_ids=share(pos),
        targets=share(targets),
        cu_seqlens=cu,
        max_seqlen=max(packed.max_seqlen, pad),
        num_tokens=packed.num_tokens,
        pad_size=pad,
        sp_size=sp,
        sp_rank=get_ulysses_sequence_parallel_rank(group),
        group=group if sp > 1 else None,
        fields={k: pad_and_share(v) for k, v in packed.fields.items()},
    )


def ulysses_model_forward(model: ForwardModel, local: UlyssesSlice, **kwargs: Any) -> ModelOutput:
    """Run the model on this rank's tokens (HF output with ``logits [1, n, ...]``).

    Args:
        model: HF model (possibly FSDP-wrapped) with ``attn_implementation="verl_ulysses"`` (any
            registered varlen attention is accepted when ``sp == 1``).
        local: This rank's :class:`UlyssesSlice`.
        **kwargs: Extra forward keywords.

    Raises:
        ValueError: ``sp > 1`` and the model does not use ``"verl_ulysses"`` attention.

    """
    config = _config_of(model)
    impl = getattr(config, "_attn_implementation", None)
    if local.sp_size > 1 and config is not None and impl != ULYSSES_ATTENTION:
        raise ValueError(
            f"sequence parallelism (sp={local.sp_size}) needs attn_implementation={ULYSSES_ATTENTION!r}, "
            f"the model uses {impl!r}; load it with attn_implementation={ULYSSES_ATTENTION!r} or call "
            f"ensure_varlen_attention(model, {ULYSSES_ATTENTION!r})"
        )
    if local.group is not None:
        kwargs[SP_GROUP_KWARG] = local.group
    return model(
        input_ids=local.input_ids,
        position_ids=local.position_ids,
        attention_mask=None,
        use_cache=False,
        **varlen_model_kwargs(local.cu_seqlens, local.max_seqlen),
        **kwargs,
    )


def ulysses_packed_outputs(
    model: ForwardModel,
    packed: PackedBatch,
    output_fn: OutputFn,
    sp_group: ProcessGroup | None = None,
    grad_scaler: bool = True,
    **kwargs: Any,
) -> dict[str, torch.Tensor]:
    """Slice, forward, reduce per token locally, gather and unpad.

    Args:
        model: See :func:`ulysses_model_forward`.
        packed: The whole packed micro-batch (the same on every SP rank).
        output_fn: ``(hf_output, local) -> {name: [n, ...]}`` per local position.
        sp_group: SP group (``None``: the current one; none at all: plain packed forward).
        grad_scaler: Scale the gathered gradient by ``sp`` (gradients averaged over SP ranks afterwards,
            e.g. FSDP over the world); ``False`` when they are summed.
        **kwargs: Extra forward keywords.

    Returns:
        ``{name: [N, ...]}`` for the whole row, identical on every SP rank.

    """
    local = ulysses_slice_packed(packed, sp_group)
    hf_output = ulysses_model_forward(model, local, **kwargs)
    return {name: local.gather(v, 0, grad_scaler) for name, v in output_fn(hf_output, local).items()}


def next_token_output_fn(temperature: float = 1.0, calculate_entropy: bool = False) -> OutputFn:
    """Per-position ``log p(next token)`` (and entropy) from the local logits, in float32.

    Position ``j`` describes the prediction made at ``j`` (of ``targets[j]``); shift with
    :func:`shift_to_targets` for the schema's convention.
    """

    def fn(hf_output: ModelOutput, local: UlyssesSlice) -> dict[str, torch.Tensor]:
        log_probs, entropy = token_log_probs_and_entropy(
            hf_output.logits, local.targets, temperature, calculate_entropy
        )
        return {"log_probs": log_probs} if entropy is None else {"log_probs": log_probs, "entropy": entropy}

    return fn


def value_output_fn(hf_output: ModelOutput, local: UlyssesSlice) -> dict[str, torch.Tensor]:
    """Per-position scalar of a value model (``logits [1, n, 1]``), float32."""
    return {"values": hf_output.logits.reshape(-1).float()}


def ulysses_packed_log_probs(
    model: ForwardModel,
    packed: PackedBatch,
    sp_group: ProcessGroup | None = None,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    grad_scaler: bool = True,
) -> dict[str, torch.Tensor]:
    """``{"log_probs": [N], "entropy": [N]}`` of a causal LM under SP, in the schema's convention.

    ``log_probs[t] = log p(input_ids[t] | the sample's tokens before t)``, 0 at each sample's first
    token — the same values as the plain packed forward (``data.packing.next_token_log_probs_and_entropy``).
    Only ``[N/sp]`` floats per output are gathered per rank.
    """
    raw = ulysses_packed_outputs(
        model, packed, next_token_output_fn(temperature, calculate_entropy), sp_group, grad_scaler
    )
    return {name: shift_to_targets(v, packed.cu_seqlens) for name, v in raw.items()}


def ulysses_packed_values(
    model: ForwardModel,
    packed: PackedBatch,
    sp_group: ProcessGroup | None = None,
    grad_scaler: bool = True,
) -> dict[str, torch.Tensor]:
    """``{"values": [N]}`` of a value model under SP (``values[t] = V(tokens before t)``, 0 at starts)."""
    raw = ulysses_packed_outputs(model, packed, value_output_fn, sp_group, grad_scaler)
    return {"values": shift_to_targets(raw["values"], packed.cu_seqlens)}


def ulysses_packed_forward(
    model: ForwardModel, packed: PackedBatch, sp_group: ProcessGroup | None = None, **kwargs: Any
) -> ModelOutput:
    """Drop-in for ``packed_forward`` under SP: the HF output with the GATHERED ``logits [1, N, ...]``.

    Gathers the full ``[N, V]`` logits — simple but ``sp`` times the memory of gathering log-probs; prefer
    :func:`ulysses_packed_log_probs` for language models. Gradients flow as in :func:`ulysses_packed_outputs`.
    """
    local = ulysses_slice_packed(packed, sp_group)
    output = ulysses_model_forward(model, local, **kwargs)
    output["logits"] = local.gather(output.logits, dim=1)
    return output
