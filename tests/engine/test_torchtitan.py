"""The torchtitan engine on a tiny Qwen3: equal to fsdp2, transformers and plain PyTorch; export; DCP resume.

One 2-rank spawn runs every multi-rank check (``_rank``); the refusals need no process group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.engine.common import OPTIM, nll_loss, padded_log_probs, random_batch, reference_step, used_targets
from verl_trainer.engine import EngineConfig, EngineRegistry, OptimConfig
from verl_trainer.models.loading import load_causal_lm
from verl_trainer.models.tiny import make_tiny_model
from verl_trainer.testing.ranks import run_distributed

pytest.importorskip("torchtitan")
pytestmark = pytest.mark.torchtitan

TOL = 1e-5
MEASURE = OptimConfig(lr=1e4, eps=1.0, weight_decay=0.0, clip_grad=1.0)
"""The invariance matrix's measuring optimizer (tests/invariance/runner.py: OPTIM): its first step is about
``-1e4 g``, so the updated weights compare the gradients (with ``eps=1e-8`` AdamW turns round-off in a
near-zero gradient, e.g. of Qwen3's q_norm, into a full ``lr``-sized step of either sign)."""


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tt") / "qwen3", arch="qwen3", hidden_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, seed=1)


def _engine(strategy: str, path: str, tp: int = 1, **overrides: Any):
    config = EngineConfig(model_path=path, micro_batch_size_per_gpu=2, tensor_model_parallel_size=tp,
                          **overrides)
    engine = EngineRegistry.new("language_model", strategy, config, MEASURE)
    engine.initialize()
    return engine


def _step(engine, shard) -> dict[str, Any]:
    """Forward (log-probs of the initial weights), one training step, the updated HF-named weights."""
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
    out = {"loss": abs(got["loss"] - want["loss"]) / abs(want["loss"]),
           "grad_norm": abs(got["grad_norm"] - want["grad_norm"]) / want["grad_norm"],
           "log_probs": _rel(got["log_probs"], want["log_probs"])}
    assert got["params"].keys() == want["params"].keys()
    out["params"] = max(_rel(got["params"][k], want["params"][k]) for k in want["params"])
    return out


def _rank(path: str, batch, tmp: str) -> dict[str, Any]:
    rank = dist.get_rank()
    report: dict[str, Any] = {}
    shard = batch[rank * 4:(rank + 1) * 4]  # dp=2: this rank's half
    # dp=2: torchtitan against fsdp2 on the same HF weights
    report["dp2"] = _compare(_step(_engine("torchtitan", path), shard), _step(_engine("fsdp2", path), shard))
    # dp=1 x tp=2 (every rank holds the whole batch): against transformers and a plain-PyTorch step. Not
    # against fsdp2 at tp=2: its TP plan leaves Qwen3's q_norm / k_norm gradients unreduced over tp
    titan = _step(_engine("torchtitan", path, tp=2), batch)
    hf = load_causal_lm(path, attn_implementation="sdpa")
    with torch.no_grad():
        logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    plain = reference_step(path, batch, MEASURE)
    want = {"loss": plain["losses"][0], "grad_norm": plain["grad_norms"][0], "params": plain["params"],
            "log_probs": padded_log_probs(logits, batch["input_ids"]) * used_targets(batch)}
    report["tp2"] = _compare(titan, want)
    # HF export of the loaded weights: bit-exact against the checkpoint
    engine = _engine("torchtitan", path)
    export = engine.save_hf(Path(tmp) / "export")
    exported = load_causal_lm(export).state_dict()
    original = load_causal_lm(path).state_dict()
    report["export_keys_equal"] = exported.keys() == original.keys()
    report["export_exact"] = all(torch.equal(exported[k], original[k]) for k in original)
    # DCP: save after step 1; step 2 of the saving engine equals step 2 of a fresh engine loaded from it
    second = batch[(1 - rank) * 4:(2 - rank) * 4]
    _step(engine, shard)
    engine.lr_scheduler_step()
    engine.save_checkpoint(str(Path(tmp) / "ckpt"), global_step=1)
    cont = _step(engine, second)
    resumed_engine = _engine("torchtitan", path)
    meta = resumed_engine.load_checkpoint(str(Path(tmp) / "ckpt"))
    resumed = _step(resumed_engine, second)
    report["resume_step"] = meta["global_step"]
    report["resume_exact"] = (cont["loss"] == resumed["loss"] and cont["grad_norm"] == resumed["grad_norm"]
                              and all(torch.equal(cont["params"][k], resumed["params"][k])
                                      for k in cont["params"]))
    return report


def test_qwen3_matches_fsdp2_transformers_exports_and_resumes(qwen3_path: str, tmp_path: Path) -> None:
    batch = random_batch(8, seed=3)
    reports = run_distributed(_rank, 2, qwen3_path, batch, str(tmp_path), timeout=600)
    for report in reports:
        for layout in ("dp2", "tp2"):
            assert all(v < TOL for v in report[layout].values()), (layout, report[layout])
        assert report["export_keys_equal"] and report["export_exact"]
        assert report["resume_step"] == 1
        assert report["resume_exact"]


@pytest.mark.parametrize(("overrides", "kwargs", "match"), [
    ({}, {"model_type": "value_model"}, "builds language models only.*value head"),
    ({"lora_rank": 4}, {}, "has no LoRA.*fsdp2"),
    ({"ulysses_sequence_parallel_size": 2}, {}, "ulysses_sequence_parallel_size=2.*fsdp2"),
    ({"pipeline_model_parallel_size": 2}, {}, "pipeline_model_parallel_size=2"),
    ({"param_dtype": "float16"}, {}, "param_dtype='float16'.*bfloat16"),
])
def test_refusals_at_construction(qwen3_path: str, overrides: dict, kwargs: dict, match: str) -> None:
    config = EngineConfig(model_path=qwen3_path, **overrides)
    with pytest.raises(ValueError, match=match):
        EngineRegistry.new(kwargs.get("model_type", "language_model"), "torchtitan", config, OPTIM)


def test_refuses_a_model_type_torchtitan_does_not_build(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "qwen2", arch="qwen2", hidden_size=32, num_hidden_layers=1)
    with pytest.raises(ValueError,
                       match=r"model_type in \('llama', 'qwen3', 'qwen3_moe'\), got model_type='qwen2'"):
        EngineRegistry.new("language_model", "torchtitan", EngineConfig(model_path=path), OPTIM)
