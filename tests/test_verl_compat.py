"""Code written against verl's modules runs on ours: core_algos and the metric API imported under verl's
module names (``verl_trainer.testing.verl_module_aliases``) behave as verl's do.

Our own checks of the behaviours verl's CPU tests pin (``test_core_algos_on_cpu.py``,
``test_value_loss_normalization_on_cpu.py``, ``test_loss_aggregation_on_cpu.py``,
``test_metric_utils_on_cpu.py``): dict-like registries that may be cleared and rebound, verl's error
message shapes, value-loss normalisation over micro-batches and DP ranks, the Dr.GRPO aggregation, and
``AggregationType`` / ``Metric`` / ``reduce_metrics``.
"""

from __future__ import annotations

import importlib
import math
from enum import Enum

import numpy as np
import pytest
import torch

import verl_trainer.core_algos as ours
from verl_trainer.core_algos import advantages
from verl_trainer.metrics import MetricAccumulator
from verl_trainer.testing import verl_module_aliases


@pytest.fixture
def aliased(monkeypatch):
    """verl's module names aliased to ours; the advantage registry and its bindings restored after."""
    builtin = advantages.ADV_ESTIMATOR_REGISTRY
    saved = dict(builtin)
    monkeypatch.setattr(ours, "ADV_ESTIMATOR_REGISTRY", builtin)  # restores any rebinding on teardown
    monkeypatch.setattr(advantages, "ADV_ESTIMATOR_REGISTRY", builtin)
    with verl_module_aliases():
        yield {name: importlib.import_module(name) for name in
               ("verl.trainer.ppo.core_algos", "verl.utils.metric", "verl.utils.metric.utils")}
    builtin.clear()
    builtin.update(saved)


# --------------------------------------------------------------------------- registries


def test_aliases_resolve_to_our_modules(aliased):
    import verl.trainer.ppo.core_algos

    assert verl.trainer.ppo.core_algos is ours and aliased["verl.trainer.ppo.core_algos"] is ours
    assert aliased["verl.utils.metric.utils"].Metric is aliased["verl.utils.metric"].Metric


def test_adv_registry_cleared_and_rebound_like_verls(aliased):
    ca = aliased["verl.trainer.ppo.core_algos"]
    assert "gae" in ca.ADV_ESTIMATOR_REGISTRY and callable(ca.ADV_ESTIMATOR_REGISTRY["rloo"])
    ca.ADV_ESTIMATOR_REGISTRY.clear()
    with pytest.raises(ValueError):
        ca.get_adv_estimator_fn("gae")
    ca.ADV_ESTIMATOR_REGISTRY = {"gae": lambda x: -x}  # a plain dict in its place: the functions follow it
    assert ca.get_adv_estimator_fn("gae")(3) == -3

    class Names(Enum):
        MINE = "mine"

    def mine():
        return "mine"

    assert ca.register_adv_est(Names.MINE)(mine) is mine
    assert ca.ADV_ESTIMATOR_REGISTRY["mine"] is mine and len(ca.ADV_ESTIMATOR_REGISTRY) == 2
    ca.register_adv_est("mine")(mine)  # the same function again: fine
    with pytest.raises(ValueError, match="already registered"):
        ca.register_adv_est("mine")(lambda: None)
    with pytest.raises(ValueError) as err:
        ca.get_adv_estimator_fn("missing")
    assert "Unknown advantage estimator simply: missing" in str(err.value) and "'gae'" in str(err.value)
    with pytest.raises(ValueError):
        ca.get_adv_estimator_fn("GAE")  # case-sensitive


def test_adv_registry_restored_after_rebinding():
    assert ours.get_adv_estimator_fn("grpo") is ours.compute_grpo_outcome_advantage  # the fixture undid it


def test_vectorized_names_are_our_batched_estimators(aliased):
    ca = aliased["verl.trainer.ppo.core_algos"]
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(12, 7, generator=g) > 0.3).float()
    mask[:, -1] = 1
    rewards = torch.randn(12, 7, generator=g) * mask
    index = np.repeat(np.arange(4), 3)
    for plain, vectorized in (("grpo", "grpo_vectorized"), ("rloo", "rloo_vectorized")):
        a = ca.get_adv_estimator_fn(plain)(token_level_rewards=rewards, response_mask=mask, index=index)
        b = ca.get_adv_estimator_fn(vectorized)(token_level_rewards=rewards, response_mask=mask, index=index)
        torch.testing.assert_close(a, b)
    assert ca.compute_rloo_vectorized_outcome_advantage is ca.compute_rloo_outcome_advantage


# --------------------------------------------------------------------------- value-loss normalisation


def _value_batch(lengths: list[int], width: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    vpreds, values, returns = (torch.randn(len(lengths), width, generator=g, dtype=torch.float64)
                               for _ in range(3))
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).to(torch.float64)
    return vpreds, values, returns, mask


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_value_loss_with_global_info_is_split_invariant(aliased, mode):
    ca = aliased["verl.trainer.ppo.core_algos"]
    vpreds, values, returns, mask = _value_batch([9, 4, 1, 7, 3, 8], 9)
    kw = {"loss_agg_mode": mode, "batch_num_tokens": int(mask.sum()), "global_batch_size": 6,
          "loss_scale_factor": 9 if mode == "seq-mean-token-sum-norm" else None}
    whole, clip_whole = ca.compute_value_loss(vpreds, returns, values, mask, 0.3, **kw)
    for parts in ([slice(0, 3), slice(3, 6)], [slice(i, i + 1) for i in range(6)]):
        split = sum(ca.compute_value_loss(vpreds[s], returns[s], values[s], mask[s], 0.3, **kw)[0]
                    for s in parts)
        torch.testing.assert_close(split, whole)
    # two DP ranks (x dp_size, averaged like FSDP's gradient) give the one-process value
    ranks = [ca.compute_value_loss(vpreds[s], returns[s], values[s], mask[s], 0.3, dp_size=2, **kw)[0]
             for s in (slice(0, 3), slice(3, 6))]
    torch.testing.assert_close(sum(ranks) / 2, whole)
    # the normalisation changes the loss only, not the clip fraction
    _, clip_local = ca.compute_value_loss(vpreds, returns, values, mask, 0.3)
    torch.testing.assert_close(clip_local, clip_whole)


def test_value_loss_without_global_info_depends_on_the_split(aliased):
    ca = aliased["verl.trainer.ppo.core_algos"]
    vpreds, values, returns, mask = _value_batch([5] * 4, 5)
    whole, _ = ca.compute_value_loss(vpreds, returns, values, mask, 0.3)
    halves = sum(ca.compute_value_loss(vpreds[s], returns[s], values[s], mask[s], 0.3)[0]
                 for s in (slice(0, 2), slice(2, 4)))
    torch.testing.assert_close(halves, 2 * whole)  # local token means, summed


def test_value_loss_gradient_and_sum_metric_match_the_whole_batch(aliased):
    ca, metric = aliased["verl.trainer.ppo.core_algos"], aliased["verl.utils.metric"]
    vpreds, values, returns, mask = _value_batch([6, 2, 5, 6], 6)
    tokens = int(mask.sum())
    whole_in = vpreds.clone().requires_grad_(True)
    whole, _ = ca.compute_value_loss(whole_in, returns, values, mask, 0.3, batch_num_tokens=tokens)
    whole.backward()
    split_in = vpreds.clone().requires_grad_(True)
    logged = {"critic/vf_loss": metric.Metric(aggregation=metric.AggregationType.SUM)}
    for s in (slice(0, 1), slice(1, 3), slice(3, 4)):
        loss, _ = ca.compute_value_loss(split_in[s], returns[s], values[s], mask[s], 0.3,
                                        batch_num_tokens=tokens)
        loss.backward()
        logged["critic/vf_loss"].append(metric.Metric(aggregation="sum", value=loss))
    torch.testing.assert_close(split_in.grad, whole_in.grad)
    assert metric.reduce_metrics(logged)["critic/vf_loss"] == pytest.approx(whole.item(), rel=1e-9)


def test_loss_scale_factor_reaches_the_value_loss(aliased):
    ca = aliased["verl.trainer.ppo.core_algos"]
    vpreds, values, returns, mask = _value_batch([4, 3], 4)
    kw = {"loss_agg_mode": "seq-mean-token-sum-norm", "global_batch_size": 2}
    a = ca.compute_value_loss(vpreds, returns, values, mask, 0.3, loss_scale_factor=3, **kw)[0]
    b = ca.compute_value_loss(vpreds, returns, values, mask, 0.3, loss_scale_factor=6, **kw)[0]
    torch.testing.assert_close(a, 2 * b)


# --------------------------------------------------------------------------- loss aggregation (Dr.GRPO)


def _dr_grpo(loss_mat, mask, factor, rows):
    return (loss_mat * mask).sum() / (rows * factor)


def test_dr_grpo_aggregation_one_piece_and_global(aliased):
    ca = aliased["verl.trainer.ppo.core_algos"]
    loss_mat = torch.arange(1.0, 16.0).reshape(3, 5)
    mask = torch.tensor([[1.0, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    # one piece, no factor: verl's padded-width fallback over the rows that have tokens
    torch.testing.assert_close(ca.agg_loss(loss_mat, mask, "seq-mean-token-sum-norm"),
                               _dr_grpo(loss_mat, mask, 5, 2))
    torch.testing.assert_close(ca.agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", loss_scale_factor=7),
                               _dr_grpo(loss_mat, mask, 7, 2))
    # an explicit global batch size counts the empty row
    torch.testing.assert_close(
        ca.agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", global_batch_size=3, loss_scale_factor=7),
        _dr_grpo(loss_mat, mask, 7, 3))
    with pytest.raises(ValueError, match="global_batch_size is required"):
        ca.agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", dp_size=2, loss_scale_factor=7)


def test_dr_grpo_two_ranks_equal_the_full_batch_with_gradients(aliased):
    ca = aliased["verl.trainer.ppo.core_algos"]
    full = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    mask = (torch.rand(4, 6) > 0.4).double()
    kw = {"loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 6}
    reference = ca.agg_loss(full, mask, **kw)
    reference.backward()
    shards = [full.detach()[s].clone().requires_grad_(True) for s in (slice(0, 2), slice(2, 4))]
    averaged = sum(ca.agg_loss(x, mask[s], dp_size=2, global_batch_size=4, **kw)
                   for x, s in zip(shards, (slice(0, 2), slice(2, 4)))) / 2
    averaged.backward()
    torch.testing.assert_close(averaged, reference.detach())
    torch.testing.assert_close(torch.cat([x.grad for x in shards]), full.grad)


# --------------------------------------------------------------------------- metric API


def test_metric_constructors_and_values(aliased):
    m = aliased["verl.utils.metric.utils"]
    assert m.AggregationType.MEAN.value == "mean" and m.AggregationType("max") is m.AggregationType.MAX
    assert m.Metric(aggregation="sum").values == [] and m.Metric("min").aggregation is m.AggregationType.MIN
    assert m.Metric(m.AggregationType.MAX, 2.0).values == [2.0]
    assert m.Metric("mean", value=[1, 2]).values == [1, 2]
    with pytest.raises(ValueError, match="sum, mean, min, max"):
        m.Metric(aggregation="median")
    metric = m.Metric(aggregation="mean")
    metric.append(3)
    metric.append(torch.tensor(4.5))
    assert metric.values == [3, 4.5] and type(metric.values[1]) is float
    with pytest.raises(ValueError, match="one-element"):
        metric.append(torch.ones(2))
    with pytest.raises(ValueError):
        metric.append("x")
    other = m.Metric(aggregation="mean", value=7.5)
    other.append(metric)  # a Metric appended adds its values
    assert other.values == [7.5, 3, 4.5] and other.aggregate() == pytest.approx(5.0)
    with pytest.raises(ValueError, match="aggregation must match"):
        other.extend(m.Metric(aggregation="sum", value=1.0))


def test_metric_aggregate_chain_from_dict_init_list(aliased):
    Metric = aliased["verl.utils.metric"].Metric  # noqa: N806  (verl's class under its name)
    values = [4.0, -2.0, 7.0, 1.0]
    expected = {"sum": 10.0, "mean": 2.5, "min": -2.0, "max": 7.0}
    for how, want in expected.items():
        metric = Metric(aggregation=how)
        metric.extend(values)
        assert metric.aggregate() == want
    a, b = Metric(aggregation="max", value=[1.0, 5.0]), Metric(aggregation="max", value=3.0)
    chained = Metric.chain([a, b])
    assert chained.values == [1.0, 5.0, 3.0] and chained.aggregate() == 5.0 and a.values == [1.0, 5.0]
    assert Metric.chain([]).aggregation.value == "mean"
    made = Metric.from_dict({"x": 1.0, "y": 2}, aggregation="sum")
    assert made["y"].values == [2] and made["x"].aggregation.value == "sum"
    empty = a.init_list()
    assert empty.values == [] and empty.aggregation is a.aggregation
    assert math.isnan(Metric(aggregation="mean").aggregate()) and Metric(aggregation="sum").aggregate() == 0
    # one Metric per DP rank: SUM is the mean over ranks of each rank's sum; equal counts required
    ranks = [Metric(aggregation="sum", value=[1.0, 2.0]), Metric(aggregation="sum", value=[3.0, 6.0])]
    assert Metric.aggregate_dp(ranks) == 6.0
    assert Metric.aggregate_dp([Metric("min", [2.0, 5.0]), Metric("min", [4.0, -1.0])]) == -1.0
    with pytest.raises(ValueError, match=r"\[2, 1\]"):
        Metric.aggregate_dp([Metric("mean", [1.0, 2.0]), Metric("mean", 1.0)])
    # ours, weighted: the weighted mean
    assert Metric.chain([Metric.mean(1.0, weight=3), Metric.mean(5.0, weight=1)]).aggregate() == 2.0


def test_reduce_metrics_verls_dict_form(aliased):
    m = aliased["verl.utils.metric"]
    metric = m.Metric(aggregation="sum", value=[1.0, 2.0])
    logged = {"loss": [1.0, 2.0, 6.0], "reward/max": [0.5, 3.0], "len/min": [4, 2], "custom": metric,
              "empty": []}
    out = m.reduce_metrics(logged)
    assert out is logged  # in place, as verl's
    assert out["loss"] == 3.0 and out["reward/max"] == 3.0 and out["len/min"] == 2 and out["custom"] == 3.0
    assert math.isnan(out["empty"])
    with pytest.raises(ValueError, match="no values"):
        m.reduce_metrics({"x/max": []})
    with pytest.raises(ValueError, match="process_group"):
        m.reduce_metrics({"x": [1.0]}, process_group=object())


def test_a_metric_with_several_values_is_several_micro_batches():
    from verl_trainer.metrics import Metric, reduce_metrics

    singles = [{"s": Metric.sum(v), "m": Metric.mean(v, weight=w), "lo": Metric.min(torch.tensor([v, -v]))}
               for v, w in ((1.0, 2), (4.0, 1), (-2.0, 5))]
    several = {"s": Metric(aggregation="sum"), "m": Metric.chain([mb["m"] for mb in singles]),
               "lo": Metric.chain([mb["lo"] for mb in singles])}
    for mb in singles:
        several["s"].append(mb["s"])
    one_dict = reduce_metrics([several])
    assert one_dict == reduce_metrics(singles)
    assert one_dict == {k: several[k].aggregate() for k in several}
    acc = MetricAccumulator()
    acc.update({"e": Metric(aggregation="max"), "s": several["s"]})  # an empty Metric declares the name only
    assert acc.compute() == {"e": -math.inf, "s": 3.0}
    assert several["s"].scale(0.5).aggregate() == 1.5 and several["s"].aggregate() == 3.0
    with pytest.raises(ValueError, match="holds 3 values"):
        _ = several["s"].value
