"""Move samples of a padded batch between ranks (variable-size all-to-all), token data only where real.

``exchange_samples(batch, dest, group)`` sends sample ``i`` of this rank's batch to rank ``dest[i]``
and returns what this rank receives, ordered by (source rank, source index) — so a partition given
as sorted global indices (rank-major) arrives in that order. Token fields travel without their
padding: only the first ``seq_len[i]`` positions of each sample are sent, and the receiver pads to its
own widest sample.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_trainer.data import schema


def token_width(batch: TensorDict) -> int | None:
    """The padded width T of the token fields, or None if the batch has no ``input_ids``."""
    return batch[schema.INPUT_IDS].shape[1] if schema.INPUT_IDS in batch.keys() else None


def is_token_key(batch: TensorDict, key: str) -> bool:
    """True for ``[B, T, ...]`` fields aligned with ``input_ids``."""
    value, width = batch[key], token_width(batch)
    return key in schema.TOKEN_KEYS or (width is not None and value.ndim >= 2 and value.shape[1] == width)


def _wire(x: torch.Tensor) -> torch.Tensor:
    # gloo has no bool all_to_all
    return x.to(torch.uint8) if x.dtype == torch.bool else x


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Variable-size all_to_all along dim 0 of ``x`` (rows sent per rank ``send``, received ``recv``)."""
    row = x.shape[1:]
    flat = _wire(x).reshape(x.shape[0], row.numel())
    out = torch.empty((sum(recv), flat.shape[1]), dtype=flat.dtype, device=flat.device)
    dist.all_to_all_single(out, flat.contiguous(), recv, send, group=group)
    return out.reshape(sum(recv), *row).to(x.dtype)


def exchange_samples(
    batch: TensorDict, dest: torch.Tensor, group: dist.ProcessGroup | None = None
) -> TensorDict:
    """Send each sample to its destination rank; return the samples this rank receives.

    Args:
        batch: Padded batch, ``batch_size=[B]``; tensor entries only.
        dest: ``[B]`` destination rank (in ``group``) of each sample.
        group: Process group (default: the world).

    Returns:
        The received batch, ``batch_size=[B']``, ordered by (source rank, source index); token fields
        padded with 0 to the longest received sample.
    """
    world = dist.get_world_size(group)
    dest = dest.long()
    if dest.numel() and (dest.min() < 0 or dest.max() >= world):
        raise ValueError(f"destination ranks must be in [0, {world}), got {dest.tolist()}")
    order = torch.argsort(dest, stable=True)
    send_counts = torch.bincount(dest, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send, recv = send_counts.tolist(), recv_counts.tolist()

    lengths = schema.sequence_lengths(batch)[order]
    recv_lengths = _all_to_all(lengths, send, recv, group)
    send_tok = torch.zeros(world, dtype=torch.long).index_add_(0, dest[order], lengths).tolist()
    recv_tok = torch.empty(world, dtype=torch.long)
    dist.all_to_all_single(recv_tok, torch.tensor(send_tok, dtype=torch.long), group=group)
    recv_tok = recv_tok.tolist()

    n_out = sum(recv)
    width = int(recv_lengths.max()) if n_out else 0
    valid_out = torch.arange(width) < recv_lengths[:, None]  # [B', T']
    out: dict[str, torch.Tensor] = {}
    for key in sorted(batch.keys()):
        value = batch[key]
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"exchange_samples moves tensors only; entry {key!r} is {type(value).__name__}. "
                "Drop non-tensor entries before balancing or encode them as tensors."
            )
        value = value[order]
        if is_token_key(batch, key):
            valid_in = torch.arange(value.shape[1]) < lengths[:, None]
            tokens = _all_to_all(value[valid_in], send_tok, recv_tok, group)  # [sum L, ...]
            padded = torch.zeros((n_out, width, *value.shape[2:]), dtype=value.dtype)
            padded[valid_out] = tokens
            out[key] = padded
        else:
            out[key] = _all_to_all(value, send, recv, group)
    return TensorDict(out, batch_size=[n_out])
