"""Router losses and metrics of a MoE model: equal across dp, micro-batching and strategy.

One 1-rank spawn (the reference: dp=1, one micro-batch, fsdp2) and one 2-rank spawn (dp=2, dynamic
micro-batches: fsdp2, fsdp, deepspeed) of a tiny Qwen3-MoE with ``aux_loss_coeff=0.01``,
``z_loss_coeff=0.001``.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.invariance.runner import backend_available
from tests.models.moe_common import max_rel, moe_steps, tiny_moe
from verl_trainer.core_algos.aggregation import GlobalBatchInfo, agg_all_tokens_loss
from verl_trainer.data.packing import make_batch
from verl_trainer.testing.ranks import run_distributed

TOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    path = tiny_moe(str(tmp_path_factory.mktemp("moe") / "model"))
    ref = run_distributed(moe_steps, 1, path, [("fsdp2", "one")], env={"DS_ACCELERATOR": "cpu"})[0][0]
    strategies = ["fsdp2", "fsdp"] + (["deepspeed"] if backend_available("deepspeed") else [])
    dp2 = run_distributed(moe_steps, 2, path, [(s, "dynamic") for s in strategies], timeout=400,
                          env={"DS_ACCELERATOR": "cpu"})
    return ref, dict(zip(strategies, dp2[0])), dp2


def test_router_losses_and_metrics_equal_across_dp_micro_batching_and_strategy(runs) -> None:
    ref, by_strategy, per_rank = runs
    names = set(ref["metrics"])
    assert {"moe/aux_loss", "moe/z_loss", "moe/router_entropy", "moe/load_imbalance",
            "moe/layer0/expert3/tokens", "moe/layer1/load_imbalance"} <= names
    # every real token is routed to k=2 experts in each layer: 2 x the batch's tokens per layer
    tokens = sum(ref["metrics"][f"moe/layer0/expert{e}/tokens"] for e in range(4))
    assert tokens == 2 * int(make_batch_tokens())
    assert ref["metrics"]["moe/aux_loss"] >= 1.0 - 1e-6  # the balanced minimum is 1
    assert 1.0 <= ref["metrics"]["moe/load_imbalance"] <= 2.0
    for strategy, result in by_strategy.items():
        assert result["micro_batches"] > 1, strategy
        assert math.isclose(result["loss"], ref["loss"], rel_tol=TOL), (strategy, result["loss"], ref["loss"])
        assert math.isclose(result["grad_norm"], ref["grad_norm"], rel_tol=TOL), strategy
        assert set(result["metrics"]) == names
        for name, value in ref["metrics"].items():
            assert math.isclose(result["metrics"][name], value, rel_tol=TOL, abs_tol=1e-9), (strategy, name)
        assert max_rel(result["params"], ref["params"]) < TOL, strategy
    for r in range(2):  # the metrics reduce to the same value on every rank
        assert per_rank[r][0]["metrics"] == per_rank[0][0]["metrics"]


def make_batch_tokens() -> int:
    from tests.engine.common import random_batch

    return int(random_batch(8, seed=3)["attention_mask"].sum())


def test_all_tokens_aggregation_is_split_invariant() -> None:
    """The new kind: per-sequence token mean over every real token, mean over the real sequences."""
    batch = make_batch([[5, 6, 7], [8], [9, 10]], [[11, 12], [13, 14, 15], [16]])
    batch["is_padding"] = torch.tensor([False, False, True])
    terms = torch.arange(batch["input_ids"].numel(), dtype=torch.float32).reshape(batch["input_ids"].shape)
    whole = agg_all_tokens_loss(terms, batch)
    mask = batch["attention_mask"].bool()
    want = sum(float(terms[i][mask[i]].mean()) for i in range(2)) / 2  # the padding row counts for nothing
    assert math.isclose(float(whole), want, rel_tol=1e-6)
    info = GlobalBatchInfo(dp_size=2, batch_num_tokens=0, global_batch_size=2)
    parts = [agg_all_tokens_loss(terms[i:i + 1], batch[i:i + 1], info) for i in range(3)]
    assert math.isclose(float(sum(parts)) / 2, want, rel_tol=1e-6)  # summed over micro, mean over dp
    with pytest.raises(ValueError, match="global_batch_size"):
        agg_all_tokens_loss(terms, batch, GlobalBatchInfo(dp_size=2, batch_num_tokens=0,
                                                           global_batch_size=None))  # type: ignore[arg-type]
