import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from verl_trainer.core_algos.balancing import calculate_workload
from verl_trainer.engine.micro_batch import (
    get_reverse_idx,
    micro_batch_lower_bound,
    min_micro_batches,
    plan_micro_batches,
    prepare_micro_batches,
    rearrange_micro_batches,
    restore_dynamic_batch,
)
from verl_trainer.testing import run_distributed

_spec = importlib.util.spec_from_file_location(
    "_verl_baseline", Path(__file__).resolve().parents[1] / "bench" / "_verl_baseline.py"
)
baseline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(baseline)

FAST = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_batch(lens, width=None, is_padding=True):
    lens = torch.as_tensor(lens, dtype=torch.long)
    b = lens.numel()
    width = width or max(int(lens.max()) if b else 1, 1)
    pos = torch.arange(width).expand(b, width)
    mask = (pos < lens[:, None]).long()
    fields = {
        "input_ids": (torch.arange(b)[:, None] * 1000 + pos + 1) * mask,
        "attention_mask": mask,
        "loss_mask": mask.float(),
        "uid": torch.arange(b),
        "seq_len": lens,
    }
    if is_padding:
        fields["is_padding"] = torch.zeros(b, dtype=torch.bool)
    return TensorDict(fields, batch_size=[b])


def check_dynamic(batch, micro, idx, budget):
    for mb in micro:
        assert mb.batch_size[0] >= 1
        assert int(mb["seq_len"].sum()) <= budget
    uid = torch.cat([mb["uid"] for mb in micro])
    assert len(idx) == uid.numel()
    assert torch.equal(restore_dynamic_batch(uid, idx), batch["uid"])


# ------------------------------------------------------------------------------------ fixed
def test_fixed_mode_splits_in_order():
    batch = make_batch([3, 1, 4, 1, 5, 9, 2])
    micro, idx = prepare_micro_batches(batch, micro_batch_size_per_gpu=3)
    assert idx is None
    assert [m.batch_size[0] for m in micro] == [3, 3, 1]
    assert torch.equal(torch.cat([m["uid"] for m in micro]), batch["uid"])
    micro, idx = prepare_micro_batches(batch, micro_batch_size_per_gpu=3, min_num_micro_batch=5)
    assert idx is None and len(micro) == 5 and all(m.batch_size[0] >= 1 for m in micro)
    micro, idx = prepare_micro_batches(batch, micro_batch_size_per_gpu=3, min_num_micro_batch=9)
    assert len(micro) == 9 and idx == list(range(7)) + [-1, -1]
    assert all(bool(m["is_padding"].all()) for m in micro[7:])


@pytest.mark.parametrize("kwargs,match", [
    ({}, "micro_batch_size_per_gpu"),
    ({"micro_batch_size_per_gpu": 0}, "micro_batch_size_per_gpu"),
    ({"use_dynamic_bsz": True}, "max_token_len_per_gpu"),
    ({"use_dynamic_bsz": True, "max_token_len_per_gpu": 8, "sp_size": 0}, "sp_size"),
])
def test_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        prepare_micro_batches(make_batch([1, 2]), **kwargs)


# ---------------------------------------------------------------------------------- dynamic
def test_dynamic_budget_count_order_and_restore():
    lens = np.random.default_rng(0).integers(50, 4001, 96)
    batch = make_batch(lens)
    micro, idx = prepare_micro_batches(batch, use_dynamic_bsz=True, max_token_len_per_gpu=4096)
    check_dynamic(batch, micro, idx, 4096)
    verl = baseline.baseline_dynamic_micro_batches(lens.tolist(), 4096)
    assert len(micro) <= len(verl)
    assert len(micro) >= max(math.ceil(lens.sum() / 4096), int((lens > 2048).sum()))
    # small-large-small: workloads rise to a peak, then fall
    work = [int(calculate_workload(m["seq_len"].numpy()).sum()) for m in micro]
    peak = int(np.argmax(work))
    assert work[: peak + 1] == sorted(work[: peak + 1]) and work[peak:] == sorted(work[peak:], reverse=True)


def test_sp_size_multiplies_budget():
    batch = make_batch([300, 300, 300, 300])
    micro, _ = prepare_micro_batches(batch, use_dynamic_bsz=True, max_token_len_per_gpu=300, sp_size=2)
    assert len(micro) == 2 and all(int(m["seq_len"].sum()) <= 600 for m in micro)


def test_over_budget_sample_raises():
    expected = r"sample of 700 tokens is longer than the micro-batch token budget 600"
    with pytest.raises(ValueError, match=expected):
        prepare_micro_batches(make_batch([5, 700]), use_dynamic_bsz=True, max_token_len_per_gpu=600)


def test_min_num_more_than_samples_pads():
    batch = make_batch([5, 7])
    micro, idx = prepare_micro_batches(
        batch, use_dynamic_bsz=True, max_token_len_per_gpu=64, min_num_micro_batch=4
    )
    assert len(micro) == 4 and idx.count(-1) == 2
    pads = [m for m, i in zip(micro, idx) if i == -1]
    assert all(bool(p["is_padding"].all()) and float(p["loss_mask"].sum()) == 0 for p in pads)
    out = torch.cat([m["uid"] for m in micro])
    assert torch.equal(restore_dynamic_batch(out, idx), batch["uid"])


def test_jagged_and_tensordict_restore():
    batch = make_batch([3, 9, 2, 7, 5])
    micro, idx = prepare_micro_batches(batch, use_dynamic_bsz=True, max_token_len_per_gpu=10)
    rows = [m["input_ids"][i, : int(m["seq_len"][i])].float() for m in micro for i in range(m.batch_size[0])]
    nested = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    restored = restore_dynamic_batch(nested, [idx])
    for i, row in enumerate(restored.unbind()):
        assert torch.equal(row, batch["input_ids"][i, : int(batch["seq_len"][i])].float())
    td = torch.cat(micro)
    assert torch.equal(restore_dynamic_batch(td, idx)["input_ids"], batch["input_ids"])
    _, per_mb = rearrange_micro_batches(batch, 10)
    assert torch.equal(restore_dynamic_batch(td["uid"], per_mb), batch["uid"])


def test_divided_by_and_plan_errors():
    batch = make_batch([10] * 5)
    micro, parts = rearrange_micro_batches(batch, 25, num_batches_divided_by=4)
    assert len(micro) == 4 and sorted(i for p in parts for i in p) == list(range(5))
    with pytest.raises(ValueError, match="need at least 3 micro-batches of 20 tokens, not 2"):
        plan_micro_batches([10] * 5, 20, num=2)
    with pytest.raises(ValueError, match="a sample of 30 tokens does not fit a budget of 20"):
        min_micro_batches([30], 20)


def _optimal_bins(lens, budget):
    best = len(lens)
    def place(i, loads):
        nonlocal best
        if len(loads) >= best:
            return
        if i == len(lens):
            best = len(loads)
            return
        for j in range(len(loads)):
            if loads[j] + lens[i] <= budget:
                loads[j] += lens[i]
                place(i + 1, loads)
                loads[j] -= lens[i]
        place(i + 1, loads + [lens[i]])
    place(0, [])
    return best


@FAST
@given(lens=st.lists(st.integers(1, 100), min_size=1, max_size=8), slack=st.integers(0, 100))
def test_lower_bound_is_a_lower_bound(lens, slack):
    budget = max(lens) + slack
    optimal = _optimal_bins(sorted(lens, reverse=True), budget)
    assert micro_batch_lower_bound(lens, budget) <= optimal <= len(min_micro_batches(lens, budget))


def test_get_reverse_idx():
    assert get_reverse_idx([2, 0, 1]) == [1, 2, 0]
    assert get_reverse_idx(torch.tensor([2, 0, 1])).tolist() == [1, 2, 0]


@FAST
@given(
    lens=st.lists(st.integers(1, 300), min_size=1, max_size=40),
    slack=st.integers(0, 400),
    min_num=st.one_of(st.none(), st.integers(1, 50)),
)
def test_dynamic_properties(lens, slack, min_num):
    budget = max(lens) + slack
    batch = make_batch(lens)
    micro, idx = prepare_micro_batches(
        batch, use_dynamic_bsz=True, max_token_len_per_gpu=budget, min_num_micro_batch=min_num
    )
    fewest = len(min_micro_batches(lens, budget))
    assert len(micro) == max(fewest, min_num or 0)
    assert fewest <= len(baseline.baseline_dynamic_micro_batches(lens, budget))
    assert fewest >= math.ceil(sum(lens) / budget)
    assert all(int(m["seq_len"].sum()) <= budget for m in micro)
    out = torch.cat([m["uid"] for m in micro])
    assert torch.equal(restore_dynamic_batch(out, idx), batch["uid"])
    assert sum(i >= 0 for i in idx) == len(lens) and all(i == -1 for i in idx[len(lens):])


# ------------------------------------------------------------------------------ distributed
def _dist_scenarios(seed):
    rank, world = dist.get_rank(), dist.get_world_size()
    rng = np.random.default_rng(seed + rank)
    out = {}
    # ranks start with very different lengths: rank r's samples are ~ (r+1)^2 times longer
    hi = 60 * (rank + 1) ** 2
    lens = rng.integers(1, hi + 1, 24)
    batch = make_batch(lens)
    micro, idx = prepare_micro_batches(batch, use_dynamic_bsz=True, max_token_len_per_gpu=1000)
    out["count"] = len(micro)
    out["local_min"] = len(min_micro_batches(lens, 1000))
    out["fits"] = all(int(m["seq_len"].sum()) <= 1000 for m in micro)
    out["nonempty"] = all(m.batch_size[0] >= 1 and not bool(m["is_padding"].any()) for m in micro)
    uid = torch.cat([m["uid"] for m in micro])
    out["restored"] = torch.equal(restore_dynamic_batch(uid, idx), batch["uid"])
    # one rank holds a sample over the budget: every rank raises ValueError, nobody hangs
    lens = rng.integers(1, 100, 8)
    if rank == world - 1:
        lens[3] = 1500
    try:
        prepare_micro_batches(make_batch(lens), use_dynamic_bsz=True, max_token_len_per_gpu=1000)
        out["over_budget"] = "no error"
    except ValueError as err:
        out["over_budget"] = str(err)
    dist.barrier()
    # fixed mode with different sample counts: the count is agreed by MAX
    n = 2 + 3 * rank
    micro, idx = prepare_micro_batches(make_batch([4] * n), micro_batch_size_per_gpu=2)
    out["fixed"] = (len(micro), idx)
    # a rank with fewer samples than the agreed dynamic count gets padding micro-batches
    lens = [900] * (2 if rank == 0 else 5)
    micro, idx = prepare_micro_batches(make_batch(lens), use_dynamic_bsz=True, max_token_len_per_gpu=1000)
    out["short_rank"] = (len(micro), idx)
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_dynamic_count_agreed_over_dp_group(world_size):
    results = run_distributed(_dist_scenarios, world_size, 7, timeout=180)
    counts = {r["count"] for r in results}
    assert len(counts) == 1 and counts == {max(r["local_min"] for r in results)}
    assert len({r["local_min"] for r in results}) > 1  # the ranks really needed different counts
    assert all(r["fits"] and r["nonempty"] and r["restored"] for r in results)
    assert all("a sample of 1500 tokens is longer" in r["over_budget"] for r in results)
    fixed_counts = {r["fixed"][0] for r in results}
    assert fixed_counts == {math.ceil((2 + 3 * (world_size - 1)) / 2)}
    assert results[-1]["fixed"][1] is None and results[0]["fixed"][1] is not None
    assert results[0]["short_rank"] == (5, [0, 1, -1, -1, -1])
    assert all(r["short_rank"][0] == 5 for r in results)
