"""torchtitan's Qwen3-MoE through the torchtitan backend: ep=2 equals ep=1 equals transformers on fsdp2.

One 2-rank spawn: at dp=2 torchtitan's MoE layer (router, all-to-all token dispatcher, experts) with
replicated experts (ep=1) and with the experts split over the two ranks (ep=2, tokens exchanged by
``all_to_all_single`` on gloo) each take one training step; loss, grad norm, log-probs and every updated
weight equal fsdp2's step on the transformers model (the same routing: no expert bias, no capacity, no
auxiliary loss) within 1e-5 relative; a checkpoint at ep=2 resumes to a bitwise equal next step; the HF
export at ep=2 (transformers 5's fused expert tensors) is bit-exact. The refusals need no process group.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.engine.common import OPTIM, random_batch
from tests.engine.test_torchtitan import TOL, _compare, _engine, _step
from verl_trainer.engine import EngineConfig, EngineRegistry
from verl_trainer.models.loading import load_causal_lm
from verl_trainer.models.tiny import make_tiny_model
from verl_trainer.testing.ranks import run_distributed

pytest.importorskip("torchtitan")
pytestmark = pytest.mark.torchtitan


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("ttmoe") / "qwen3_moe", arch="qwen3_moe", hidden_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, seed=1)


def _rank(path: str, batch, tmp: str) -> dict[str, Any]:
    rank = dist.get_rank()
    shard = batch[rank * 4:(rank + 1) * 4]
    reference = _step(_engine("fsdp2", path), shard)
    ep1 = _step(_engine("torchtitan", path), shard)
    ep2_engine = _engine("torchtitan", path, expert_model_parallel_size=2)
    local = ep2_engine.module.layers["0"].moe.routed_experts.inner_experts.w1_EFD
    export = ep2_engine.save_hf(Path(tmp) / "export")  # the loaded weights, before the step
    ep2 = _step(ep2_engine, shard)
    # checkpoint at ep=2: save after step 1; step 2 continued equals step 2 of a fresh engine loaded from it
    other = batch[(1 - rank) * 4:(2 - rank) * 4]
    ep2_engine.save_checkpoint(str(Path(tmp) / "ckpt"), global_step=1)
    cont = _step(ep2_engine, other)
    resumed_engine = _engine("torchtitan", path, expert_model_parallel_size=2)
    resumed_step = resumed_engine.load_checkpoint(str(Path(tmp) / "ckpt"))["global_step"]
    resumed = _step(resumed_engine, other)
    exported = load_causal_lm(export).state_dict()
    original = load_causal_lm(path).state_dict()
    return {"ep1_vs_fsdp2": _compare(ep1, reference), "ep2_vs_ep1": _compare(ep2, ep1),
            "ep2_vs_fsdp2": _compare(ep2, reference), "local_experts": int(local.to_local().shape[0]),
            "export_keys_equal": exported.keys() == original.keys(),
            "export_exact": all(torch.equal(exported[k], original[k]) for k in original),
            "resume_step": resumed_step,
            "resume_exact": (cont["loss"] == resumed["loss"] and cont["grad_norm"] == resumed["grad_norm"]
                             and all(torch.equal(v, resumed["params"][k])
                                     for k, v in cont["params"].items()))}


def test_qwen3_moe_ep2_equals_ep1_equals_fsdp2(moe_path: str, tmp_path: Path) -> None:
    reports = run_distributed(_rank, 2, moe_path, random_batch(8, seed=3), str(tmp_path), timeout=600)
    for report in reports:
        for pair in ("ep1_vs_fsdp2", "ep2_vs_ep1", "ep2_vs_fsdp2"):
            assert all(v < TOL for v in report[pair].values()), (pair, report[pair])
        assert report["local_experts"] == 2  # 4 experts split over ep=2
        assert report["export_keys_equal"] and report["export_exact"]
        assert report["resume_step"] == 1 and report["resume_exact"]


def test_expert_parallel_refusals(moe_path: str, tmp_path: Path) -> None:
    dense = make_tiny_model(tmp_path / "qwen3", arch="qwen3", hidden_size=32, num_hidden_layers=1)
    cases = [
        ("torchtitan", dense, {"expert_model_parallel_size": 2}, r"expert_model_parallel_size=2 needs a "
         r"mixture-of-experts model.*'qwen3'"),
        ("torchtitan", moe_path, {"expert_model_parallel_size": 3}, r"does not divide the model's 4 experts; "
         r"choose one of \[1, 2, 4\]"),
        ("torchtitan", moe_path, {"expert_model_parallel_size": 2, "tensor_model_parallel_size": 2},
         "with tensor_model_parallel_size=2"),
        ("fsdp2", moe_path, {"expert_model_parallel_size": 2}, r"expert_model_parallel_size=2 is not "
         r"supported by the 'fsdp2' backend.*'torchtitan' or 'megatron'"),
    ]
    for strategy, path, overrides, match in cases:
        with pytest.raises(ValueError, match=match):
            EngineRegistry.new("language_model", strategy, EngineConfig(model_path=path, **overrides), OPTIM)
    with pytest.raises(ValueError, match="expert_model_parallel_size must be an int >= 1"):
        EngineConfig(expert_model_parallel_size=0)


@pytest.mark.parametrize(("option", "value"), [("router_replay", "rollout"), ("aux_loss_coeff", 1e-3),
                                               ("z_loss_coeff", 1e-3)])
def test_refuses_the_hf_engines_router_options(moe_path: str, option: str, value: Any) -> None:
    config = EngineConfig(model_path=moe_path)
    moe = {"router_replay": "off", "aux_loss_coeff": 0.0, "z_loss_coeff": 0.0, option: value}
    config.moe = SimpleNamespace(**moe)  # EngineConfig.moe of the HF engines' MoE settings
    with pytest.raises(ValueError, match=rf"moe.{option}={value!r} is not served by strategy='torchtitan'"):
        EngineRegistry.new("language_model", "torchtitan", config, OPTIM)
