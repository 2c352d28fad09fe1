"""Images in balancing and micro-batching: sizes count patch rows, and samples carry their images."""

from __future__ import annotations

import torch
import torch.distributed as dist

from verl_trainer.core_algos.balancing import balance_batch
from verl_trainer.data import schema
from verl_trainer.data.packing import make_batch
from verl_trainer.data.vision import model_vision_inputs, pad_vision
from verl_trainer.engine.micro_batch import prepare_micro_batches


def _batch(rank: int, n: int):
    """Rank-specific samples; sample i has i % 3 images of 4 x (i + 1) patch rows, pixel value = its uid."""
    uids = [100 * rank + i for i in range(n)]
    batch = make_batch([[5] * (3 + i) for i in range(n)], [[6] * 2 for _ in range(n)], uids=uids)
    pixels, grids = [], []
    for i, uid in enumerate(uids):
        grid = torch.tensor([[1, 2, 2 * (i + 1)]] * (i % 3), dtype=torch.long).reshape(-1, 3)
        pixels.append(torch.full((int(grid.prod(-1).sum()), 6), float(uid)))
        grids.append(grid)
    batch.update(pad_vision(pixels, grids))  # P and I differ per rank (rank 1 has fewer, shorter images)
    return batch


def test_sample_sizes_count_patch_rows():
    batch = _batch(0, 4)
    patches = torch.tensor([0, 8, 24, 0])
    assert schema.sample_sizes(batch).tolist() == (batch["seq_len"] + patches).tolist()
    micro, idx = prepare_micro_batches(batch, use_dynamic_bsz=True, max_token_len_per_gpu=32)
    assert all(int(schema.sample_sizes(m).sum()) <= 32 for m in micro)  # the budget holds tokens + patch rows
    assert sum(int(m["seq_len"].sum()) for m in micro) == int(batch["seq_len"].sum())
    assert len(micro) > 1 and sorted(idx) == [0, 1, 2, 3]


def balance_on_rank(sizes):
    """Balance :func:`_batch` shards of ``sizes`` over the world; per received sample
    ``(uid, seq_len, patch rows, pixel values)``. Runs inside ``tests/engine/test_vlm_engine.py``'s spawn."""
    rank = dist.get_rank()
    mine, _ = balance_batch(_batch(rank, sizes[rank]), batch_multiple=1)
    out = []
    for i in range(mine.batch_size[0]):
        row = mine[i : i + 1]
        vision = model_vision_inputs(row)
        pixels = vision.get("pixel_values", torch.zeros(0, 6))
        out.append((int(row["uid"][0]), int(row["seq_len"][0]), pixels.shape[0],
                    sorted(set(pixels.reshape(-1).tolist()))))
    return out


def check_balanced(per_rank):
    """Every sample arrived once, with every patch row of its own images (and no other sample's)."""
    seen = [s for rank in per_rank for s in rank]
    assert sorted(s[0] for s in seen) == sorted([*range(BALANCE_SIZES[0]), *(100 + i for i in range(2))])
    for uid, seq_len, rows, values in seen:
        i = uid % 100
        assert seq_len == 5 + i
        assert rows == 4 * (i + 1) * (i % 3)
        assert values == ([float(uid)] if rows else [])


BALANCE_SIZES = [6, 2]
"""Rank 0 holds 6 samples (images up to 48 patch rows), rank 1 two (8): different ``P`` and ``I``."""
