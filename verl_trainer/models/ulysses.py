"""Ulysses sequence parallelism: the communication primitives (verl-compatible names and signatures).

Each rank of a sequence-parallel (SP) group holds ``1/sp`` of a packed row. Around attention the row is
re-distributed with one all-to-all: from (``N/sp`` tokens, all ``H`` heads) to (all ``N`` tokens,
``H/sp`` heads) — :func:`gather_seq_scatter_heads` — and back after it — :func:`gather_heads_scatter_seq`.
Everything else (embeddings, MLPs, norms, the LM head) runs on the local ``N/sp`` tokens.

The functions keep the names, argument order and semantics of ``verl.utils.ulysses`` (verl 0.9.1); the
implementation is this project's own. Invariants: :class:`SeqAllToAll`'s backward is the mirror
all-to-all; :func:`gather_outputs_and_unpad` with ``grad_scaler=True`` leaves the loss and the gradient
unchanged by ``sp`` under data-parallel wrappers that average over ``dp * sp`` ranks. ``async_op`` is
accepted for compatibility and runs synchronously.

The SP group is a process-wide setting (:func:`set_ulysses_sequence_parallel_group`, verl's name) that
can be overridden for a block with :func:`ulysses_sequence_parallel_group`; every function also takes
``group=`` explicitly. With no group (or a group of one rank) every function is the identity.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.distributed import ProcessGroup

_ULYSSES_SEQUENCE_PARALLEL_GROUP: ProcessGroup | None = None


# ---------------------------------------------------------------------------------------- the SP group
def set_ulysses_sequence_parallel_group(group: ProcessGroup | None) -> None:
    """Set (or clear, with ``None``) the process-wide Ulysses SP group."""
    global _ULYSSES_SEQUENCE_PARALLEL_GROUP
    _ULYSSES_SEQUENCE_PARALLEL_GROUP = group


def get_ulysses_sequence_parallel_group() -> ProcessGroup | None:
    """Return the current Ulysses SP group (``None`` when SP is off)."""
    return _ULYSSES_SEQUENCE_PARALLEL_GROUP


def get_ulysses_sequence_parallel_world_size(group: ProcessGroup | None = None) -> int:
    """Return the SP size of ``group`` (default: the current group); 1 without a group."""
    group = get_ulysses_sequence_parallel_group() if group is None else group
    return dist.get_world_size(group) if group is not None else 1


def get_ulysses_sequence_parallel_rank(group: ProcessGroup | None = None) -> int:
    """Return this process's rank inside ``group`` (default: the current group); 0 without a group."""
    group = get_ulysses_sequence_parallel_group() if group is None else group
    return dist.get_rank(group) if group is not None else 0


@contextlib.contextmanager
def ulysses_sequence_parallel_group(group: ProcessGroup | None) -> Iterator[None]:
    """Make ``group`` the current SP group inside the block and restore the previous one after it."""
    previous = get_ulysses_sequence_parallel_group()
    set_ulysses_sequence_parallel_group(group)
    try:
        yield
    finally:
        set_ulysses_sequence_parallel_group(previous)


# ---------------------------------------------------------------------------------------- pad / slice
def _pad_tensor(x: torch.Tensor, dim: int, padding_size: int, value: float = 0) -> torch.Tensor:
    """Append ``padding_size`` entries filled with ``value`` along ``dim``."""
    if padding_size <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = padding_size
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def _unpad_tensor(x: torch.Tensor, dim: int, padding_size: int) -> torch.Tensor:
    """Drop the last ``padding_size`` entries along ``dim``."""
    if padding_size <= 0:
        return x
    return x.narrow(dim, 0, x.size(dim) - padding_size)


def slice_input_tensor(
    x: torch.Tensor, dim: int, padding: bool = True, group: ProcessGroup | None = None
) -> torch.Tensor:
    """This rank's contiguous ``1/sp`` slice of ``x`` along ``dim``.

    Args:
        x: Any tensor, e.g. a packed row ``[1, N]``.
        dim: Dimension to split.
        padding: Pad ``dim`` with zeros to a multiple of ``sp`` first; with ``False`` an indivisible size
            is an error.
        group: SP group (default: the current one).

    Returns:
        ``x.narrow(dim, rank * N / sp, N / sp)`` (a view, made contiguous).

    """
    group = get_ulysses_sequence_parallel_group() if group is None else group
    sp = get_ulysses_sequence_parallel_world_size(group)
    if sp == 1:
        return x
    size = x.size(dim)
    if size % sp:
        if not padding:
            raise ValueError(
                f"cannot slice a dimension of size {size} over sp={sp} ranks; pad it to a multiple of "
                f"{sp} first (ulysses_pad) or pass padding=True"
            )
        x = _pad_tensor(x, dim, sp - size % sp)
    part = x.size(dim) // sp
    return x.narrow(dim, get_ulysses_sequence_parallel_rank(group) * part, part).contiguous()


def ulysses_pad(
    input_ids_rmpad: torch.Tensor, position_ids_rmpad: torch.Tensor | None = None, sp_size: int = 1
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """Pad a packed row on the right to a multiple of ``sp_size`` tokens.

    The padding tokens get id 0 and position ids ``0, 1, ..``, so they form a segment of their own (a
    new segment starts wherever the position does not go up by one) and never attend to a real sample.

    Args:
        input_ids_rmpad: ``[1, N]`` packed token ids.
        position_ids_rmpad: ``[1, N]`` (or ``[C, 1, N]`` for multi-axis rotary) position ids, or ``None``.
        sp_size: SP size.

    Returns:
        ``(input_ids [1, N + pad], position_ids [.., N + pad] | None, pad_size)``.

    """
    if position_ids_rmpad is not None:
        if position_ids_rmpad.size(-2) != 1 or position_ids_rmpad.size(-1) != input_ids_rmpad.size(-1):
            raise ValueError(
                f"position_ids_rmpad {tuple(position_ids_rmpad.shape)} must be [.., 1, N] and aligned with "
                f"input_ids_rmpad {tuple(input_ids_rmpad.shape)}"
            )
    if sp_size <= 1:
        return input_ids_rmpad, position_ids_rmpad, 0
    total = input_ids_rmpad.size(-1)
    pad_size = (sp_size - total % sp_size) % sp_size
    if pad_size:
        input_ids_rmpad = F.pad(input_ids_rmpad, (0, pad_size), value=0)
        if position_ids_rmpad is not None:
            pad_pos = torch.arange(pad_size, device=position_ids_rmpad.device, dtype=position_ids_rmpad.dtype)
            pad_pos = pad_pos.expand(*position_ids_rmpad.shape[:-1], pad_size)
            position_ids_rmpad = torch.cat([position_ids_rmpad, pad_pos], dim=-1)
    return input_ids_rmpad, position_ids_rmpad, pad_size


def ulysses_pad_and_slice_inputs(
    input_ids_rmpad: torch.Tensor,
    position_ids_rmpad: torch.Tensor | None = None,
    sp_size: int = 1,
    skip_position_ids_rmpad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """Pad a packed row to a multiple of ``sp_size`` (:func:`ulysses_pad`) and keep this rank's slice.

    Args:
        input_ids_rmpad: ``[1, N]``.
        position_ids_rmpad: ``[1, N]`` (or ``[C, 1, N]``), or ``None``.
        sp_size: SP size (the current SP group supplies the rank).
        skip_position_ids_rmpad: Pad the position ids but return them whole (not sliced).

    Returns:
        ``(input_ids [1, (N + pad) / sp], position_ids [.., (N + pad) / sp] | None, pad_size)``.

    """
    if sp_size > 1 and get_ulysses_sequence_parallel_world_size() != sp_size:
        raise ValueError(
            f"sp_size={sp_size} but the current Ulysses SP group has "
            f"{get_ulysses_sequence_parallel_world_size()} rank(s); call "
            "set_ulysses_sequence_parallel_group(sp_group) first"
        )
    input_ids_rmpad, position_ids_rmpad, pad_size = ulysses_pad(input_ids_rmpad, position_ids_rmpad, sp_size)
    if sp_size > 1:
        input_ids_rmpad = slice_input_tensor(input_ids_rmpad, dim=1, padding=False)
        if position_ids_rmpad is not None and not skip_position_ids_rmpad:
            position_ids_rmpad = slice_input_tensor(position_ids_rmpad, dim=-1, padding=False)
    return input_ids_rmpad, position_ids_rmpad, pad_size


# ---------------------------------------------------------------------------------------- all-to-all
def all_to_all_tensor(
    local_input: torch.Tensor,
    scatter_dim: int,
    gather_dim: int,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> torch.Tensor:
    """Split along ``scatter_dim``, send chunk ``i`` to rank ``i``, concatenate along ``gather_dim``.

    The received chunks are concatenated in rank order.

    Args:
        local_input: Tensor whose ``scatter_dim`` is divisible by ``sp``.
        scatter_dim: Dimension that shrinks ``sp`` times.
        gather_dim: Dimension that grows ``sp`` times.
        group: SP group (default: the current one).
        async_op: Accepted for verl compatibility; the exchange always completes before returning.

    Returns:
        The exchanged tensor, e.g. ``[1, H, N/sp, D] -> [1, H/sp, N, D]`` for ``scatter_dim=1,
        gather_dim=2``.

    """
    del async_op
    group = get_ulysses_sequence_parallel_group() if group is None else group
    sp = get_ulysses_sequence_parallel_world_size(group)
    if sp == 1:
        return local_input
    if local_input.size(scatter_dim) % sp:
        raise ValueError(
            f"all-to-all: dimension {scatter_dim} of shape {tuple(local_input.shape)} is not divisible "
            f"by the sequence-parallel size {sp}"
        )
    send = torch.stack(local_input.chunk(sp, dim=scatter_dim)).contiguous()  # [sp, ...chunk]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class SeqAllToAll(torch.autograd.Function):
    """Differentiable :func:`all_to_all_tensor`; the backward is the mirror all-to-all."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        group: ProcessGroup | None,
        local_input: torch.Tensor,
        scatter_dim: int,
        gather_dim: int,
        async_op: bool = False,
    ) -> torch.Tensor:
        """All-to-all ``local_input`` from ``scatter_dim`` to ``gather_dim`` over ``group``."""
        ctx.group = group
        ctx.scatter_dim = scatter_dim
        ctx.gather_dim = gather_dim
        return all_to_all_tensor(local_input, scatter_dim, gather_dim, group, async_op)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_output: torch.Tensor) -> tuple:
        """Send the gradient back where the forward took it from (gather and scatter dims swapped)."""
        grad = all_to_all_tensor(grad_output.contiguous(), ctx.gather_dim, ctx.scatter_dim, ctx.group)
        return None, grad, None, None, None


def gather_seq_scatter_heads(
    x: torch.Tensor,
    seq_dim: int,
    head_dim: int,
    unpadded_dim_size: int = 0,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """All-to-all from (``N/sp`` tokens, all heads) to (all ``N`` tokens, ``1/sp`` of the heads).

    Args:
        x: e.g. ``[1, H, N/sp, D]`` (``seq_dim=2, head_dim=1``) or ``[1, N/sp, H, D]``.
        seq_dim: Sequence dimension (gathered).
        head_dim: Head dimension (scattered; must be divisible by ``sp``).
        unpadded_dim_size: Full sequence length without padding; when given and not a multiple of
            ``sp``, the padding is cut off the gathered sequence.
        group: SP group (default: the current one).

    Returns:
        e.g. ``[1, H/sp, N, D]``.

    """
    group = get_ulysses_sequence_parallel_group() if group is None else group
    sp = get_ulysses_sequence_parallel_world_size(group)
    if sp == 1:
        return x
    x = SeqAllToAll.apply(group, x, head_dim, seq_dim)
    if unpadded_dim_size and unpadded_dim_size % sp:
        x = _unpad_tensor(x, seq_dim, x.size(seq_dim) - unpadded_dim_size)
    return x


def gather_heads_scatter_seq(
    x: torch.Tensor, head_dim: int, seq_dim: int, group: ProcessGroup | None = None
) -> torch.Tensor:
    """All-to-all from (all ``N`` tokens, ``1/sp`` of the heads) back to (``N/sp`` tokens, all heads).

    A sequence that is not a multiple of ``sp`` is padded first.

    Args:
        x: e.g. ``[1, N, H/sp, D]`` (``head_dim=2, seq_dim=1``).
        head_dim: Head dimension (gathered).
        seq_dim: Sequence dimension (scattered).
        group: SP group (default: the current one).

    Returns:
        e.g. ``[1, N/sp, H, D]``.

    """
    group = get_ulysses_sequence_parallel_group() if group is None else group
    sp = get_ulysses_sequence_parallel_world_size(group)
    if sp == 1:
        return x
    if x.size(seq_dim) % sp:
        x = _pad_tensor(x, seq_dim, sp - x.size(seq_dim) % sp)
    return SeqAllToAll.apply(group, x, seq_dim, head_dim)


# ---------------------------------------------------------------------------------------- gather outputs
def all_gather_tensor(
    local_tensor: torch.Tensor, gather_dim: int, group: ProcessGroup | None = None
) -> torch.Tensor:
    """Concatenate the (equal-shaped) tensors of every SP rank along ``gather_dim``, in rank order."""
    group = get_ulysses_sequence_parallel_group() if group is None else group
    sp = get_ulysses_sequence_parallel_world_size(group)
    if sp == 1:
        return local_tensor
    parts = [torch.empty_like(local_tensor) for _ in range(sp)]
    dist.all_gather(parts, local_tensor.contiguous(), group=group)
    return torch.cat(parts, dim=gather_dim)


class Gather(torch.autograd.Function):
    """Differentiable all-gather; the backward keeps this rank's slice (× ``sp`` with ``grad_scaler``)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        group: ProcessGroup | None,
        local_tensor: torch.Tensor,
        gather_dim: int,
        grad_scaler: bool = True,
        async_op: bool = False,
    ) -> torch.Tensor:
        """All-gather ``local_tensor`` along ``gather_dim``."""
        del async_op
        ctx.group = group
        ctx.gather_dim = gather_dim
        ctx.grad_scaler = grad_scaler
        ctx.sp = get_ulysses_sequence_parallel_world_size(group)
        ctx.rank = get_ulysses_sequence_parallel_rank(group)
        ctx.part = local_tensor.size(gather_dim)
        return all_gather_tensor(local_tensor, gather_dim, group)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_output: torch.Tensor) -> tuple:
        """This rank's slice of the gradient, scaled by ``sp`` when ``grad_scaler``."""
        grad = grad_output.narrow(ctx.gather_dim, ctx.rank * ctx.part, ctx.part)
        # Every SP rank computes the same loss from the same gathered outputs, and each rank's parameter
        # gradient holds only the part that flows through its own tokens: the true gradient is the SUM
        # over the SP group. Wrappers that AVERAGE over dp * sp ranks (FSDP over the world) then need
        # the factor sp for their average to equal the DP average of the true gradients.
        if ctx.grad_scaler:
            grad = grad * ctx.sp
        return None, grad.contiguous(), None, None, None


def gather_outputs_and_unpad(
    x: torch.Tensor,
    gather_dim: int,
    unpad_dim: int | None = None,
    padding_size: int = 0,
    grad_scaler: bool = True,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """Gather per-rank outputs of a sliced packed row and drop the padding added by :func:`ulysses_pad`.

    Args:
        x: This rank's outputs, e.g. log-probs ``[N_pad/sp]`` or logits ``[1, N_pad/sp, V]``.
        gather_dim: Sequence dimension of ``x``.
        unpad_dim: Dimension to unpad (usually ``gather_dim``); ``None``: keep the padding.
        padding_size: ``pad_size`` returned by :func:`ulysses_pad_and_slice_inputs`.
        grad_scaler: Multiply the backward by ``sp`` (right when gradients are
            then AVERAGED over the SP ranks, as FSDP over the whole world does; use ``False`` when they
            are SUMMED).
        group: SP group (default: the current one).

    Returns:
        e.g. ``[N]``: the outputs of the whole row, identical on every SP rank.

    """
    group = get_ulysses_sequence_parallel_group() if group is None else group
    if get_ulysses_sequence_parallel_world_size(group) == 1:
        return x
    x = Gather.apply(group, x, gather_dim, grad_scaler)
    if unpad_dim is not None:
        x = _unpad_tensor(x, unpad_dim, padding_size)
    return x
