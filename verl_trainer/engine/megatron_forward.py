"""The forward of a Megatron ``GPTModel`` on one packed micro-batch, laid out as the model-type part reads it.

The engine's loop packs a micro-batch into one row (``data/packing.py: PackedBatch``). Megatron's local
attention takes no packed sequences, so :func:`packed_logits` runs ``GPTModel`` on the samples as
right-padded rows ``[b, s]`` (positions ``0 .. s-1``, a causal mask: a real token never sees the padding
after it) and gathers the logits back to the packed row's tokens, only at the positions whose outputs are
used (``engine/heads.py: head_positions``). The logits are this TP rank's slice of the vocabulary (Megatron's
``parallel_output``), the vocabulary padding of the last slice cut off; with ``tp > 1`` the engine sets
``model_type.vocab_slice`` so the log-probs are reduced from the slices (``engine/vocab_parallel.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from verl_trainer.data.packing import PackedBatch, unpack_to_padded
from verl_trainer.engine.heads import head_positions

__all__ = ["LogitsOutput", "common_shape", "packed_logits"]


@dataclass
class LogitsOutput:
    """What ``ModelType.outputs`` reads of a forward: ``logits [1, K, V_local]``."""

    logits: torch.Tensor


def _row_index(packed: PackedBatch, width: int) -> torch.Tensor:
    """``[N]``: the flat index ``sample * width + offset`` of every token of the packed row."""
    lengths = packed.seq_lens.to(torch.long)
    sample = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    starts = packed.cu_seqlens[:-1].to(device=lengths.device, dtype=torch.long)
    offset = torch.arange(int(lengths.sum()), device=lengths.device) - starts[sample]
    return sample * width + offset


def common_shape(packed: PackedBatch, group: dist.ProcessGroup) -> tuple[int, int]:
    """``(rows, width)``: the largest ``[b, s]`` of this micro-batch over ``group`` (a collective).

    Megatron's all-gather MoE token dispatcher gathers equal-sized token blocks from every EP rank, so under
    EP on CPU each rank's rows are padded to the EP group's largest shape.
    """
    shape = torch.tensor([int(packed.seq_lens.numel()), int(packed.max_seqlen)], dtype=torch.int64)
    dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=group)
    return int(shape[0]), int(shape[1])


def packed_logits(model: torch.nn.Module, packed: PackedBatch, vocab_rows: int,
                  pad_to: tuple[int, int] | None = None) -> LogitsOutput:
    """Run ``model`` (``GPTModel`` or its DDP wrapper) on ``packed``'s samples as right-padded rows.

    Args:
        model: Called as ``model(input_ids [b, s], position_ids [b, s], attention_mask [1, 1, s, s])`` and
            returning logits ``[b, s, V_local]``.
        packed: The packed micro-batch.
        vocab_rows: Real token ids in this rank's vocabulary slice (the columns kept).
        pad_to: At least this many ``(rows, width)`` (more padding rows / columns, outputs unused).

    Returns:
        ``logits [1, K, vocab_rows]`` at :func:`head_positions` (``K = N`` when every output is used).
    """
    width = max(int(packed.max_seqlen), pad_to[1] if pad_to else 0)
    device = packed.input_ids.device
    ids = unpack_to_padded(packed.input_ids, packed.cu_seqlens, width, pad_value=0)
    if pad_to is not None and pad_to[0] > ids.shape[0]:
        ids = torch.cat([ids, ids.new_zeros(pad_to[0] - ids.shape[0], width)])
    positions = torch.arange(width, device=device).expand(ids.shape[0], -1)
    causal = torch.triu(torch.ones(width, width, dtype=torch.bool, device=device), diagonal=1)[None, None]
    logits = model(ids, positions, causal)
    rows = _row_index(packed, width).to(device)
    used = head_positions(packed)
    if used is not None:
        rows = rows[used.to(device)]
    flat = logits.reshape(-1, logits.shape[-1])[rows, :vocab_rows]
    return LogitsOutput(flat[None])
