"""``group_id``: a group's samples stay on one rank (balance_batch) and in one micro-batch
(prepare_micro_batches); the group-mean aggregation (agg_group_loss, GlobalBatchInfo.global_num_groups)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from verl_trainer.core_algos.aggregation import GlobalBatchInfo, agg_group_loss, compute_global_batch_info
from verl_trainer.core_algos.balancing import balance_batch
from verl_trainer.data import schema
from verl_trainer.data.packing import make_batch
from verl_trainer.engine.micro_batch import prepare_micro_batches, restore_dynamic_batch
from verl_trainer.testing import run_distributed

LENS = [14, 3, 38, 6, 9, 25, 4, 60, 7, 11, 5, 18, 20, 2]


def pair_batch(lens=LENS, first_group=0, uid_offset=0):
    """Samples ``2p``, ``2p + 1`` share ``group_id = first_group + p``."""
    prompts = [[5] * 2 for _ in lens]
    responses = [[6] * (n - 2) for n in lens]
    batch = make_batch(prompts, responses, uids=torch.arange(len(lens)) + uid_offset)
    batch.set(schema.GROUP_ID, torch.arange(len(lens)) // 2 + first_group)
    return batch


def groups_whole(micro_batches):
    ids = [set(mb[schema.GROUP_ID][schema.real_mask(mb)].tolist()) for mb in micro_batches]
    return all(not (a & b) for i, a in enumerate(ids) for b in ids[i + 1:])


@pytest.mark.parametrize("kwargs", [{"micro_batch_size_per_gpu": 1}, {"micro_batch_size_per_gpu": 3},
                                    {"use_dynamic_bsz": True, "max_token_len_per_gpu": 70}])
def test_micro_batches_keep_groups_whole_and_restore_order(kwargs):
    batch = pair_batch()
    micro, idx = prepare_micro_batches(batch, **kwargs)
    assert groups_whole(micro) and sum(mb.batch_size[0] for mb in micro) == len(LENS)
    restored = restore_dynamic_batch(torch.cat(micro), idx)
    assert torch.equal(restored[schema.INPUT_IDS], batch[schema.INPUT_IDS])
    if "max_token_len_per_gpu" in kwargs:
        assert all(int(mb[schema.ATTENTION_MASK].sum()) <= 70 for mb in micro)
    else:  # runs of whole groups of about the asked size (a group larger than it alone)
        assert all(mb.batch_size[0] <= max(2, kwargs["micro_batch_size_per_gpu"]) for mb in micro)


def test_without_group_id_micro_batching_is_unchanged():
    batch = pair_batch().exclude(schema.GROUP_ID)
    micro, idx = prepare_micro_batches(batch, micro_batch_size_per_gpu=1)
    assert idx is None and len(micro) == len(LENS)  # sample by sample, as before


def test_a_group_over_the_token_budget_is_a_clear_error():
    with pytest.raises(ValueError, match=r"sample group \(group_id\) of 64 tokens"):
        prepare_micro_batches(pair_batch(), use_dynamic_bsz=True, max_token_len_per_gpu=63)


def test_agg_group_loss_is_the_mean_over_the_step_groups():
    losses = torch.tensor([1.0, 2.0, 3.0])
    assert float(agg_group_loss(losses, None)) == pytest.approx(2.0)
    assert float(agg_group_loss(losses[:1], 3, dp_size=2)) == pytest.approx(2 / 3)  # partial x dp
    with pytest.raises(ValueError, match="global_num_groups"):
        agg_group_loss(losses, None, dp_size=2)
    info = GlobalBatchInfo.from_batch(pair_batch())
    assert info.global_num_groups == len(LENS) // 2
    assert GlobalBatchInfo.from_batch(pair_batch().exclude(schema.GROUP_ID)).global_num_groups is None


def _balance_on_rank(sizes):
    rank = dist.get_rank()
    start = sum(sizes[:rank])
    batch = pair_batch(uid_offset=0)[start:start + sizes[rank]]  # global group ids: a pair may straddle
    mine, metrics = balance_batch(batch, None, hidden_size=32, batch_multiple=4)
    info = compute_global_batch_info(mine, dist.group.WORLD, dist.get_world_size(), rank)
    micro, _ = prepare_micro_batches(mine, None, use_dynamic_bsz=True, max_token_len_per_gpu=70)
    return {"groups": mine[schema.GROUP_ID][schema.real_mask(mine)].tolist(),
            "uids": mine[schema.UID].tolist(),
            "padding": int((~schema.real_mask(mine)).sum()), "samples": mine.batch_size[0],
            "num_groups": info.global_num_groups, "metrics": metrics, "whole": groups_whole(micro),
            "micro": len(micro)}


def test_balancing_brings_each_group_onto_one_rank_with_equal_counts():
    out = run_distributed(_balance_on_rank, 2, [9, 5])  # pair (8, 9) starts on two ranks
    groups = [set(r["groups"]) for r in out]
    assert not groups[0] & groups[1] and groups[0] | groups[1] == set(range(len(LENS) // 2))
    for r in out:
        assert sorted(r["groups"]) == sorted(g for g in set(r["groups"]) for _ in (0, 1)), "both of each pair"
        assert r["num_groups"] == len(LENS) // 2 and r["whole"]
    assert out[0]["samples"] == out[1]["samples"] == 8 and out[0]["padding"] + out[1]["padding"] == 2
    uids = out[0]["uids"] + out[1]["uids"]
    assert len(set(uids)) == len(uids) and set(range(len(LENS))) <= set(uids)
    assert out[0]["metrics"] == out[1]["metrics"] and out[0]["micro"] == out[1]["micro"]
