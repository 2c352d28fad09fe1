"""A sample's compute size for balancing and dynamic micro-batching: its tokens plus its image patch rows.

A vision-language sample costs its ``seq_len`` tokens in the language model and its images' patch rows
(``data.vision.patch_counts``: ``t * h * w`` per image, before the 2x2 merge) in the vision tower, whose
blocks run on every patch row. Karmarkar-Karp balancing over the DP ranks (``core_algos/balancing.py``)
and the dynamic micro-batch token budget (``engine/micro_batch.py``) both count ``seq_len + patch rows``;
a batch without images counts ``seq_len``, as before.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_trainer.data import schema
from verl_trainer.data.vision import has_vision, patch_counts

__all__ = ["pad_vision_to_group", "sample_sizes", "vision_keys"]


def sample_sizes(batch: TensorDict) -> torch.Tensor:
    """``[B]`` long: ``schema.sequence_lengths(batch)`` plus each sample's image patch rows (if any)."""
    lens = schema.sequence_lengths(batch)
    if not has_vision(batch):
        return lens
    return lens + patch_counts(batch[schema.IMAGE_GRID_THW]).to(lens)


def vision_keys(batch: TensorDict) -> tuple[str, ...]:
    """The per-sample vision fields ``batch`` holds (``pixel_values``, ``image_grid_thw``)."""
    return tuple(k for k in (schema.PIXEL_VALUES, schema.IMAGE_GRID_THW) if k in batch.keys())


def pad_vision_to_group(batch: TensorDict, group: dist.ProcessGroup | None) -> TensorDict:
    """``batch`` with its vision fields zero-padded to the group's widest (``P`` rows, ``I`` images).

    Sending samples between ranks needs the same row shape everywhere; a collective over ``group``
    (one all-reduce, also with no vision field: then nothing changes).
    """
    keys = vision_keys(batch)
    widths = torch.tensor([batch[k].shape[1] if k in keys else 0
                           for k in (schema.PIXEL_VALUES, schema.IMAGE_GRID_THW)], dtype=torch.long)
    dist.all_reduce(widths, op=dist.ReduceOp.MAX, group=group)
    if not keys:
        return batch
    out = batch.clone(recurse=False)
    for key, width in zip((schema.PIXEL_VALUES, schema.IMAGE_GRID_THW), widths.tolist(), strict=True):
        if key in keys and batch[key].shape[1] < width:
            value = batch[key]
            pad = value.new_zeros((value.shape[0], width - value.shape[1], *value.shape[2:]))
            out.set(key, torch.cat([value, pad], dim=1))
    return out
