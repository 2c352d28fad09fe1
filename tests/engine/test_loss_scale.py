"""precision="16-mixed" on 2 gloo ranks: float16 compute with a dynamic loss scale (GradScaler for fsdp2,
ShardedGradScaler for fsdp) — the loss and grad norm agree with float32, an overflowing step is skipped on
every rank with the scale halved, and a checkpoint restores the scale (then steps bitwise alike)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from verl_trainer.engine import OptimConfig
from verl_trainer.testing.ranks import run_distributed

from .common import build_engine, collect_params, nll_loss, random_batch, rank_shard, tiny_model

OPTIM = OptimConfig(lr=1e-3, clip_grad=1.0)
FP16 = {"param_dtype": "float16", "reduce_dtype": "float32", "model_dtype": "float32"}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"))


def _huge_loss(model_output, micro_batch, info):
    """A finite loss (float32) whose gradients overflow float16 at any scale >= 1."""
    loss, metrics = nll_loss(model_output, micro_batch, info)
    return loss * 1e8, metrics


def _set_scale(engine, scale: float) -> None:
    state = engine.grad_scaler.state_dict()
    engine.grad_scaler.load_state_dict({**state, "scale": scale})


def _fp16_rank(backend, model_path, batch, ckpt):
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = rank_shard(batch, rank, world)
    fp32 = build_engine(backend, "language_model", model_path, OPTIM, micro_batch_size_per_gpu=2)
    fp16 = build_engine(backend, "language_model", model_path, OPTIM, micro_batch_size_per_gpu=2, **FP16)
    _set_scale(fp16, 1024.0)  # below torch's 2**16 default, so this step does not overflow
    want, got = fp32.train_batch(shard, nll_loss), fp16.train_batch(shard, nll_loss)
    before = collect_params(fp16)
    overflow = fp16.train_batch(shard, _huge_loss)
    unchanged = all(torch.equal(before[k], v) for k, v in collect_params(fp16).items())
    fp16.save_checkpoint(ckpt, global_step=2)
    again = build_engine(backend, "language_model", model_path, OPTIM, micro_batch_size_per_gpu=2, **FP16)
    fresh_scale = again.loss_scale
    again.load_checkpoint(ckpt)
    loaded_scale = again.loss_scale
    steps = [engine.train_batch(shard, nll_loss) for engine in (fp16, again)]
    pa, pb = collect_params(fp16), collect_params(again)
    return {"want": want, "got": got, "overflow": overflow, "unchanged": unchanged,
            "skipped": fp16.skipped_steps, "scaler": type(fp16.grad_scaler).__name__,
            "fp32_scale": want["loss_scale"],
            "fresh_scale": fresh_scale, "loaded_scale": loaded_scale, "steps": steps,
            "resumed_exact": all(torch.equal(pa[k], pb[k]) for k in pa)}


@pytest.mark.slow  # 50-90 s per backend on 2 shared cores; the default run checks the set-up only
@pytest.mark.parametrize("backend", ["fsdp2", "fsdp"])
def test_fp16_steps_overflow_and_resume(backend, model_path, tmp_path):
    out = run_distributed(_fp16_rank, 2, backend, model_path, random_batch(8, seed=3), str(tmp_path / "ckpt"))
    scaler = {"fsdp2": "GradScaler", "fsdp": "ShardedGradScaler"}[backend]
    for r in out:
        assert r["scaler"] == scaler and r["fp32_scale"] is None
        # float16 compute, unscaled before the norm: loss and grad norm agree with float32
        assert r["got"]["loss"] == pytest.approx(r["want"]["loss"], rel=2e-3)
        assert r["got"]["grad_norm"] == pytest.approx(r["want"]["grad_norm"], rel=2e-2)
        assert not r["got"]["step_skipped"] and r["got"]["loss_scale"] == 1024.0
        # overflow: finite loss, inf gradients -> skipped on every rank, parameters untouched, scale halved
        o = r["overflow"]
        assert o["step_skipped"] and o["loss_scale_overflow"] and math.isfinite(o["loss"])
        assert not math.isfinite(o["grad_norm"]) and o["loss_scale"] == 512.0
        assert r["unchanged"] and r["skipped"] == 1
        # the checkpoint restores the scale; the next step is the same as without the save / load
        assert r["fresh_scale"] == 65536.0 and r["loaded_scale"] == 512.0
        assert r["steps"][0]["loss"] == r["steps"][1]["loss"] and r["resumed_exact"]
        assert not r["steps"][0]["step_skipped"]
    assert out[0]["overflow"]["grad_norm"] == out[1]["overflow"]["grad_norm"] or \
        all(math.isnan(r["overflow"]["grad_norm"]) for r in out)
