"""Metric reductions: declared SUM/MEAN/MIN/MAX, reduced over micro-batches locally and over real gloo ranks
through torchmetrics; the logged values of a step equal its one-process, one-micro-batch values."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tests.test_losses import LOSS_CASES, SPLIT_DP2, make_batch, one_shot_info, run_split
from verl_trainer.metrics import Metric, MetricAccumulator, Reduction, reduce_metrics
from verl_trainer.testing import run_distributed


def test_metric_declares_reduction_and_validates():
    assert Metric.sum(1.0).reduction is Reduction.SUM
    assert Metric(2.0, "max").reduction is Reduction.MAX
    with pytest.raises(ValueError, match="sum, mean, min, max"):
        Metric(1.0, "median")
    with pytest.raises(ValueError, match="scalar"):
        Metric.sum(torch.ones(3))
    with pytest.raises(ValueError, match="weight"):
        Metric(1.0, Reduction.SUM, weight=2.0)
    t = torch.ones((), requires_grad=True) * 2
    assert not Metric.sum(t).value.requires_grad


def test_local_reductions():
    out = reduce_metrics([
        {"s": Metric.sum(1.5), "m": Metric.mean(2.0, weight=1), "lo": Metric.min(torch.tensor([3.0, -1.0])),
         "hi": Metric.max(torch.tensor([3.0, -1.0])), "u": Metric.mean(4.0)},
        {"s": Metric.sum(torch.tensor(2.5)), "m": Metric.mean(5.0, weight=3), "lo": Metric.min(0.0),
         "hi": Metric.max(torch.tensor([])), "u": Metric.mean(6.0)},
    ])
    assert out == {"s": 4.0, "m": pytest.approx((2 + 15) / 4), "lo": -1.0, "hi": 3.0, "u": 5.0}


def test_token_mean_is_invariant_to_splitting_and_padding_micro_batches():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(6, 5, generator=g)
    mask = torch.rand(6, 5, generator=g) > 0.5
    mask[4:] = False  # padding samples
    one = reduce_metrics([{"x": Metric.token_mean(values, mask)}])["x"]
    parts = reduce_metrics([{"x": Metric.token_mean(values[i:i + 1], mask[i:i + 1])} for i in range(6)])["x"]
    assert one == pytest.approx(float(values[mask].mean()), rel=1e-6)
    assert parts == pytest.approx(one, rel=1e-6)


def test_undeclared_values_and_changed_reduction_are_errors():
    acc = MetricAccumulator()
    with pytest.raises(TypeError, match="declare its reduction"):
        acc.update({"loss": 1.0})
    acc.update({"x": Metric.sum(1.0)})
    with pytest.raises(ValueError, match="one reduction"):
        acc.update({"x": Metric.mean(1.0)})


def test_nan_is_logged_not_dropped():
    assert math.isnan(reduce_metrics([{"x": Metric.mean(float("nan"), 2)}, {"x": Metric.mean(1.0, 1)}])["x"])


# --------------------------------------------------------------------------- real gloo ranks


def _close(a: dict[str, float], b: dict[str, float]) -> list[str]:
    """Names whose values differ beyond 1e-6 (relative and absolute), plus key mismatches."""
    bad = sorted(a.keys() ^ b.keys())
    bad += [k for k in a.keys() & b.keys() if not math.isclose(a[k], b[k], rel_tol=1e-6, abs_tol=1e-6)]
    return bad


def _metrics_on_ranks() -> dict:
    """Per rank: for every loss case, the one-shot metrics and the metrics reduced over 2 gloo ranks."""
    rank = dist.get_rank()
    data, out = make_batch()
    results: dict = {}
    for case, build in sorted(LOSS_CASES.items()):
        fn = build()
        one_shot = reduce_metrics([fn(out, data, one_shot_info(data))[1]], sync_dist=False)
        # dp=2: this rank's micro-batches (rank 1 has a padding-only micro-batch)
        _, per_rank = run_split(fn, data, out, SPLIT_DP2)
        dp2 = reduce_metrics(per_rank[rank])
        # sp=2 style: both ranks hold the whole batch (duplicates), split into micro-batches differently
        splits = [[[0, 1, 2, 3, 4, 5, 6, 7]], [[3], [0, 6, 1], [2, 4, 5, 7]]]
        _, dup = run_split(fn, data, out, [splits[rank]])
        sp2 = reduce_metrics(dup[0])
        results[case] = {"one_shot": one_shot, "dp2": dp2, "sp2_duplicates": sp2}

    # A name only rank 0 produced must not hang rank 1; MIN/MAX/SUM/MEAN over ranks.
    extra = {"only0/max": Metric.max(5.0)} if rank == 0 else {}
    results["primitives"] = reduce_metrics([{
        "s": Metric.sum(float(rank + 1)),
        "m": Metric.mean(float(rank), weight=rank + 1),
        "lo": Metric.min(torch.tensor([10.0 - rank, 20.0])),
        "hi": Metric.max(torch.tensor([10.0 + rank])),
        **extra,
    }])
    # Different reductions for one name on different ranks: a clear error on every rank, no hang.
    try:
        reduce_metrics([{"bad": Metric.sum(1.0) if rank == 0 else Metric.mean(1.0)}])
        results["mismatch"] = None
    except ValueError as err:
        results["mismatch"] = str(err)
    return results


def test_reduced_metrics_over_gloo_ranks_equal_one_shot_values():
    per_rank = run_distributed(_metrics_on_ranks, 2, timeout=180)
    for rank, results in enumerate(per_rank):
        for case in LOSS_CASES:
            r = results[case]
            assert not _close(r["dp2"], r["one_shot"]), (rank, case, "dp2", r["dp2"], r["one_shot"])
            assert not _close(r["sp2_duplicates"], r["one_shot"]), (rank, case, "sp2", r["sp2_duplicates"])
        assert results["primitives"] == {
            "s": pytest.approx((1 + 2) / 2),  # SUM: mean over ranks of each rank's micro-batch sum
            "m": pytest.approx((0 * 1 + 1 * 2) / 3),
            "lo": 9.0,
            "hi": 11.0,
            "only0/max": 5.0,
        }
        assert results["mismatch"] is not None and "'bad'" in results["mismatch"]
    assert per_rank[0]["ppo_vanilla_token_mean"]["dp2"] == per_rank[1]["ppo_vanilla_token_mean"]["dp2"]
