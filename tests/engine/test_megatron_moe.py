"""Qwen3-MoE through the Megatron engine: ep=2 equals ep=1 equals transformers on fsdp2.

One 2-rank spawn: at dp=2 Megatron's ``MoELayer`` with replicated experts (ep=1) and with the experts split
over the two ranks (``expert_model_parallel_size=2``: the all-gather token dispatcher on gloo) each take one
training step; loss, grad norm, log-probs and every updated weight equal fsdp2's step on the transformers
model (the same routing) within 1e-5 relative; a checkpoint at ep=2 resumes to a bitwise equal next step;
the HF export at ep=2 (experts gathered over EP, fused as transformers 5 keeps them) is bit-exact. The
refusals need no process group.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from verl_trainer.engine import EngineConfig, EngineRegistry, OptimConfig  # noqa: E402
from verl_trainer.models.loading import load_causal_lm  # noqa: E402
from verl_trainer.models.tiny import make_tiny_model  # noqa: E402
from verl_trainer.testing.ranks import run_distributed  # noqa: E402

from .common import nll_loss, random_batch  # noqa: E402

pytestmark = pytest.mark.megatron

TOL = 1e-5
MEASURE = OptimConfig(lr=1e4, eps=1.0, weight_decay=0.0, clip_grad=1.0)
"""The invariance matrix's measuring AdamW (its first step is about ``-1e4 g``: the updated weights compare
the gradients)."""


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("mgmoe") / "qwen3_moe", arch="qwen3_moe", hidden_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, seed=1)


def _engine(strategy: str, path: str, **overrides: Any):
    config = EngineConfig(model_path=path, micro_batch_size_per_gpu=2, **overrides)
    engine = EngineRegistry.new("language_model", strategy, config, MEASURE)
    engine.initialize()
    return engine


def _step(engine, shard) -> dict[str, Any]:
    with engine.eval_mode():
        log_probs = engine.infer_batch(shard)["model_output"]["log_probs"]
    with engine.train_mode():
        out = engine.train_batch(shard, nll_loss)
    params = {k: v.detach().clone() for k, v in engine.get_per_tensor_param()}
    return {"loss": out["loss"], "grad_norm": out["grad_norm"], "log_probs": log_probs, "params": params}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.double().norm())
    diff = float((a.double() - b.double()).norm())
    return diff / scale if scale else diff


def _compare(got: dict[str, Any], want: dict[str, Any]) -> dict[str, float]:
    assert got["params"].keys() == want["params"].keys(), (sorted(got["params"]), sorted(want["params"]))
    return {"loss": abs(got["loss"] - want["loss"]) / abs(want["loss"]),
            "grad_norm": abs(got["grad_norm"] - want["grad_norm"]) / want["grad_norm"],
            "log_probs": _rel(got["log_probs"], want["log_probs"]),
            "params": max(_rel(got["params"][k], want["params"][k]) for k in want["params"])}


def _rank(path: str, batch, tmp: str) -> dict[str, Any]:
    rank = dist.get_rank()
    shard = batch[rank * 4:(rank + 1) * 4]
    reference = _step(_engine("fsdp2", path), shard)
    ep1 = _step(_engine("megatron", path), shard)
    ep2_engine = _engine("megatron", path, expert_model_parallel_size=2)
    local_experts = len(ep2_engine.gpt_model.decoder.layers[0].mlp.experts.local_experts)
    export = ep2_engine.save_hf(Path(tmp) / "export")  # the loaded weights, before the step
    ep2 = _step(ep2_engine, shard)
    # checkpoint at ep=2: save after step 1; step 2 continued equals step 2 of a fresh engine loaded from it
    other = batch[(1 - rank) * 4:(2 - rank) * 4]
    ep2_engine.save_checkpoint(str(Path(tmp) / "ckpt"), global_step=1)
    cont = _step(ep2_engine, other)
    resumed_engine = _engine("megatron", path, expert_model_parallel_size=2)
    resumed_step = resumed_engine.load_checkpoint(str(Path(tmp) / "ckpt"))["global_step"]
    resumed = _step(resumed_engine, other)
    try:  # each rank's file holds its experts: another EP size is refused
        _engine("megatron", path).load_checkpoint(str(Path(tmp) / "ckpt"))
        other_ep_refused = ""
    except ValueError as error:
        other_ep_refused = str(error)
    exported = load_causal_lm(export).state_dict()
    original = load_causal_lm(path).state_dict()
    return {"ep1_vs_fsdp2": _compare(ep1, reference), "ep2_vs_ep1": _compare(ep2, ep1),
            "ep2_vs_fsdp2": _compare(ep2, reference), "local_experts": local_experts,
            "export_keys_equal": exported.keys() == original.keys(),
            "export_exact": all(torch.equal(exported[k], original[k]) for k in original),
            "resume_step": resumed_step, "other_ep_refused": other_ep_refused,
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
        assert "'expert_model_parallel_size': 2}, this run has" in report["other_ep_refused"]


def test_expert_parallel_refusals(moe_path: str, tmp_path: Path) -> None:
    dense = make_tiny_model(tmp_path / "qwen2", arch="qwen2", hidden_size=32, num_hidden_layers=1)
    cases = [
        (dense, {"expert_model_parallel_size": 2}, r"expert_model_parallel_size=2 needs a mixture-of-experts "
         r"model.*'qwen2'"),
        (moe_path, {"expert_model_parallel_size": 3}, r"does not divide the model's 4 experts; choose one of "
         r"\[1, 2, 4\]"),
        (moe_path, {"expert_model_parallel_size": 2, "tensor_model_parallel_size": 2},
         "with tensor_model_parallel_size=2"),
    ]
    for path, overrides, match in cases:
        with pytest.raises(ValueError, match=match):
            EngineRegistry.new("language_model", "megatron", EngineConfig(model_path=path, **overrides),
                               MEASURE)


@pytest.mark.parametrize(("option", "value"), [("router_replay", "old_policy"), ("aux_loss_coeff", 1e-3)])
def test_refuses_the_hf_engines_router_options(moe_path: str, option: str, value: Any) -> None:
    config = EngineConfig(model_path=moe_path)
    moe = {"router_replay": "off", "aux_loss_coeff": 0.0, "z_loss_coeff": 0.0, option: value}
    config.moe = SimpleNamespace(**moe)  # EngineConfig.moe of the HF engines' MoE settings
    with pytest.raises(ValueError, match=rf"moe.{option}={value!r} is not served by strategy='megatron'"):
        EngineRegistry.new("language_model", "megatron", config, MEASURE)
