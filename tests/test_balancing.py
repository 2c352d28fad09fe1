import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from verl_trainer.core_algos.balancing import (
    calculate_workload,
    get_seqlen_balanced_partitions,
    greedy_partition,
    karmarkar_karp,
    log_seqlen_unbalance,
    required_batch_multiple,
    upsample_batch_to_multiple,
)
from verl_trainer.core_algos.karmarkar_karp import stable_argsort
from verl_trainer.data.schema import padding_samples

_spec = importlib.util.spec_from_file_location(
    "_verl_baseline", Path(__file__).resolve().parents[1] / "bench" / "_verl_baseline.py"
)
baseline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(baseline)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _sums(values, parts):
    return sorted(int(sum(values[i] for i in p)) for p in parts)


def _imbalance(values, parts):
    s = np.array([sum(values[i] for i in p) for p in parts], dtype=np.float64)
    return (s.max() - s.mean()) / s.mean()


def _assert_partition(parts, n, k):
    assert len(parts) == k
    assert all(p and p == sorted(p) for p in parts)
    assert sorted(i for p in parts for i in p) == list(range(n))


# ---------------------------------------------------------------------------------- workload
def test_calculate_workload_kinds_and_constant():
    lens = [1, 10, 4000]
    expect = [24576 * x + x * x for x in lens]
    assert calculate_workload(lens) == expect
    assert calculate_workload(np.array(lens)).tolist() == expect
    out = calculate_workload(torch.tensor(lens))
    assert isinstance(out, torch.Tensor) and out.tolist() == expect
    assert calculate_workload([3], hidden_size=10) == [6 * 10 * 3 + 9]


# ---------------------------------------------------------------------------- karmarkar-karp
@FAST
@given(
    k=st.integers(1, 7),
    data=st.data(),
    equal_size=st.booleans(),
    hi=st.sampled_from([2, 10, 1000, 10**7]),
)
def test_kk_matches_textbook_heap(k, data, equal_size, hi):
    n = data.draw(st.integers(k, 40))
    if equal_size:
        n -= n % k
    values = data.draw(st.lists(st.integers(0, hi), min_size=n, max_size=n))
    ours = karmarkar_karp(values, k, equal_size)
    ref = baseline.baseline_get_seqlen_balanced_partitions(values, k, equal_size)
    _assert_partition(ours, n, k)
    # same algorithm and tie-breaking: identical set sums (items of equal value may swap)
    assert _sums(values, ours) == _sums(values, ref)
    if len(set(values)) == n:
        assert sorted(ours) == sorted(ref)
    if equal_size:
        assert {len(p) for p in ours} == {n // k}


@pytest.mark.parametrize("n,k,equal_size", [(1024, 8, True), (2048, 64, True), (2048, 64, False)])
def test_kk_workload_quality_matches_baseline(n, k, equal_size):
    lens = np.random.default_rng(n + k).integers(50, 4001, n)
    work = calculate_workload(lens.tolist())
    ours = get_seqlen_balanced_partitions(work, k, equal_size)
    ref = baseline.baseline_get_seqlen_balanced_partitions(work, k, equal_size)
    _assert_partition(ours, n, k)
    assert _imbalance(work, ours) <= _imbalance(work, ref) + 1e-15
    assert _imbalance(work, ours) <= 1e-5


def test_kk_tensor_numpy_list_agree():
    lens = np.random.default_rng(1).integers(50, 4001, 512)
    work = calculate_workload(lens)
    a = karmarkar_karp(work.tolist(), 16, True)
    assert karmarkar_karp(work, 16, True) == a
    assert karmarkar_karp(torch.from_numpy(work), 16, True) == a
    assert karmarkar_karp(torch.from_numpy(work).float().double(), 16, True) == a


def test_kk_large_values_and_fractions_still_partition():
    rng = np.random.default_rng(2)
    huge = (rng.integers(1, 2**40, 300)).tolist()  # totals overflow the encoding: quantised
    _assert_partition(karmarkar_karp(huge, 6, True), 300, 6)
    frac = rng.random(100).tolist()
    parts = karmarkar_karp(frac, 4, False)
    _assert_partition(parts, 100, 4)
    assert _imbalance(frac, parts) < 1e-3


def test_stable_argsort_radix_path():
    rng = np.random.default_rng(3)
    for hi in (2, 3000, 2**30, 2**45, 2**60):
        v = rng.integers(0, hi, 9000)
        assert np.array_equal(stable_argsort(v), np.argsort(v, kind="stable"))


@pytest.mark.parametrize(
    "args,match",
    [
        (([1, 2, 3], 4, False), r"3 items into k_partitions=4"),
        (([1, 2, 3, 4, 5], 2, True), r"\(5\) .*k_partitions=2.*5 % 2 = 1"),
        (([1, 2], 0, False), r"k_partitions must be an integer >= 1, got 0"),
        (([1, -7, 3], 1, False), r"seqlen_list\[1\] = -7"),
    ],
)
@pytest.mark.parametrize("fn", [karmarkar_karp, greedy_partition, get_seqlen_balanced_partitions])
def test_invalid_input_raises_value_error(fn, args, match):
    with pytest.raises(ValueError, match=match):
        fn(*args)


# ---------------------------------------------------------------------------------- greedy
def test_greedy_is_longest_first():
    # verl's input-order greedy gives sums 6 and 2 here; longest-first gives 4 and 4
    parts = greedy_partition([1, 1, 1, 1, 4], 2, False)
    assert _sums([1, 1, 1, 1, 4], parts) == [4, 4]
    _assert_partition(parts, 5, 2)


@FAST
@given(st.lists(st.integers(0, 5000), min_size=4, max_size=60), st.integers(1, 4))
def test_greedy_equal_size(values, k):
    n = len(values) - len(values) % k
    parts = greedy_partition(values[:n], k, True)
    _assert_partition(parts, n, k)
    assert {len(p) for p in parts} == {n // k}


# ------------------------------------------------------------------------------------ logging
def test_log_seqlen_unbalance():
    lens = [10, 10, 1, 1]
    m = log_seqlen_unbalance(lens, [[0, 2], [1, 3]], "x")
    assert m["x/min"] == 2 and m["x/max"] == 20 and m["x/minmax_diff"] == 18
    assert m["x/balanced_min"] == 11 and m["x/balanced_max"] == 11 and m["x/mean"] == 11
    assert m["x/workload_imbalance"] == 0.0
    names = ("min", "max", "minmax_diff", "balanced_min", "balanced_max", "mean", "workload_imbalance")
    assert set(m) == {f"x/{k}" for k in names}


def test_required_batch_multiple():
    assert required_batch_multiple(4) == 4
    assert required_batch_multiple(4, actor_mini_batch_size=6, n=1) == 12
    assert required_batch_multiple(8, actor_mini_batch_size=3, critic_mini_batch_size=4, n=2) == 24
    assert math.lcm(8, 6, 8) == 24
    with pytest.raises(ValueError, match="dp_size must be a positive integer, got 0"):
        required_batch_multiple(0)


# ------------------------------------------------------------------------------------ padding
def _batch(lens, width=8, uids=None):
    b = len(lens)
    pos = torch.arange(width).expand(b, width)
    mask = (pos < torch.tensor(lens)[:, None]).long()
    return TensorDict(
        {
            "input_ids": (torch.arange(b * width).view(b, width) + 100) * mask,
            "attention_mask": mask,
            "position_ids": pos * mask,
            "loss_mask": mask.float(),
            "advantages": torch.randn(b, width) * mask,
            "uid": torch.tensor(uids if uids is not None else [7] * b),
            "seq_len": torch.tensor(lens),
            "prompt_len": torch.ones(b, dtype=torch.long),
            "response_len": torch.tensor(lens) - 1,
        },
        batch_size=[b],
    )


def test_upsample_batch_to_multiple():
    batch = _batch([5, 3, 8], uids=[4, 4, 9])
    assert upsample_batch_to_multiple(batch, 3) is batch
    out = upsample_batch_to_multiple(batch, 4)
    assert out.batch_size == torch.Size([4])
    assert out["is_padding"].tolist() == [False, False, False, True]
    assert torch.equal(out[:3]["input_ids"], batch["input_ids"])
    pad = out[3]
    assert pad["loss_mask"].sum() == 0 and pad["advantages"].abs().sum() == 0
    assert pad["attention_mask"].tolist() == [1] + [0] * 7
    assert int(pad["input_ids"][0]) == int(batch["input_ids"][1, 0])  # shortest real sample's first token
    assert int(pad["seq_len"]) == 1 and int(pad["response_len"]) == 0 and int(pad["prompt_len"]) == 1
    assert int(pad["uid"]) == 10
    out8 = upsample_batch_to_multiple(out, 8)
    assert out8.batch_size == torch.Size([8])
    uids = out8["uid"].tolist()
    assert uids[4:] == [11, 12, 13, 14] and len(set(uids[3:])) == 5
    assert out8["is_padding"].sum() == 5


def test_make_padding_samples_from_empty_batch():
    empty = _batch([5])[:0]
    pad = padding_samples(empty, 2)
    assert pad.batch_size == torch.Size([2]) and pad["input_ids"].shape == (2, 8)
    assert pad["attention_mask"][:, 0].tolist() == [1, 1] and pad["loss_mask"].sum() == 0


def test_upsample_invalid_multiple():
    with pytest.raises(ValueError, match="multiple must be a positive integer, got 0"):
        upsample_batch_to_multiple(_batch([1]), 0)
