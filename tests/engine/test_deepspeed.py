"""DeepSpeed engine (ZeRO-1/2/3) on 2 gloo CPU ranks against a single-process plain-PyTorch step.

One distributed run per ZeRO stage (module-scoped fixture) does everything that needs ranks: a forward,
a language-model step, save -> step vs load -> step, an inference-only engine, a non-finite step, a
value-model step with counted gradient reductions. The tests below assert on its results. One more run
checks Ulysses sequence parallelism (sp=2) under ZeRO-3.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.engine.common import (
    assert_close_params,
    build_engine,
    collect_params,
    nll_loss,
    padded_log_probs,
    random_batch,
    rank_shard,
    reference_step,
    relative_error,
    tiny_model,
    used_targets,
    value_loss,
)
from verl_trainer.engine import EngineConfig, EngineRegistry, OptimConfig
from verl_trainer.testing import run_distributed

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")

WORLD = 2
STAGES = [1, 2, 3]
# Warmup of one step: the first step runs at the full lr (as the plain reference); the cosine makes the
# lr of later steps differ, so a scheduler that is not restored shows in the resumed step.
OPTIM = OptimConfig(lr=1e-3, clip_grad=1.0, lr_scheduler="cosine", warmup_steps=1, total_training_steps=6)
ENV = {"DS_ACCELERATOR": "cpu"}


def _nan_on_rank1(model_output, micro_batch, info):
    loss, metrics = nll_loss(model_output, micro_batch, info)
    if dist.get_rank() == 1:
        loss = loss * float("nan")
    return loss, metrics


def _count_gradient_reductions() -> list[int]:
    """Count calls of DeepSpeed's reduce / all-to-all collectives in this process (a one-element list)."""
    import deepspeed.comm as dcomm

    counter = [0]
    for name in dir(dcomm):
        fn = getattr(dcomm, name)
        if ("reduce" in name or "all_to_all" in name) and name[0].islower() and not name.startswith("has_") \
                and callable(fn):
            def counted(*args, _fn=fn, **kwargs):
                counter[0] += 1
                return _fn(*args, **kwargs)
            setattr(dcomm, name, counted)
    return counter


def _train(engine: Any, batch: Any, loss_fn: Any) -> dict[str, Any]:
    with engine.train_mode():
        out = engine.train_batch(batch, loss_fn)
    out["lr_after"] = engine.lr_scheduler_step()
    return out


def _stage_run(stage: int, model_path: str, batch: Any, batch2: Any, ckpt: str) -> dict[str, Any]:
    """Everything one ZeRO stage needs ranks for; rank 0 returns tensors, every rank the scalars."""
    rank = dist.get_rank()
    backend = f"deepspeed_stage_{stage}"
    shard, shard2 = rank_shard(batch, rank, WORLD), rank_shard(batch2, rank, WORLD)
    out: dict[str, Any] = {}

    engine = build_engine(backend, "language_model", model_path, OPTIM, micro_batch_size_per_gpu=2)
    with engine.eval_mode():
        out["forward"] = engine.infer_batch(shard, calculate_entropy=True)["model_output"]
    out["lm_step"] = _train(engine, shard, nll_loss)
    out["lm_params"] = collect_params(engine)
    engine.save_checkpoint(ckpt, global_step=1)
    out["rng_after_save"] = torch.rand(4)
    out["continued_step"] = _train(engine, shard2, nll_loss)
    out["continued_params"] = collect_params(engine)
    # an inference-only engine (a reference policy) next to the trained one; loads the checkpoint's weights
    ref = build_engine(backend, "language_model", model_path, None, micro_batch_size_per_gpu=2)
    with ref.eval_mode():
        out["ref_forward"] = ref.infer_batch(shard)["model_output"]["log_probs"]
    out["ref_meta"] = ref.load_checkpoint(ckpt)
    out["ref_params"] = collect_params(ref)
    del engine, ref

    engine = build_engine(backend, "language_model", model_path, OPTIM, micro_batch_size_per_gpu=2)
    out["meta"] = engine.load_checkpoint(ckpt)
    out["rng_after_load"] = torch.rand(4)
    out["resumed_step"] = _train(engine, shard2, nll_loss)
    out["resumed_params"] = collect_params(engine)
    with engine.train_mode():
        out["nan_step"] = engine.train_batch(shard, _nan_on_rank1)
    out["skipped_steps"] = engine.skipped_steps
    out["params_after_nan"] = collect_params(engine)
    del engine

    engine = build_engine(backend, "value_model", model_path, OPTIM, micro_batch_size_per_gpu=2)
    counter, seen = _count_gradient_reductions(), []

    def counting_value_loss(model_output, micro_batch, info):
        seen.append(counter[0])  # before this micro-batch's backward
        return value_loss(model_output, micro_batch, info)

    out["value_step"] = _train(engine, shard, counting_value_loss)
    out["reductions"] = [*seen, counter[0]]
    out["value_params"] = collect_params(engine)
    if rank != 0:  # the other ranks only report scalars (their tensors are checked equal via the loss)
        out = {k: v for k, v in out.items() if k.endswith("_step") or k == "meta"}
    return out


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return tiny_model(str(tmp_path_factory.mktemp("ds_tiny") / "model"))


@pytest.fixture(scope="module")
def batches() -> tuple[Any, Any]:
    return random_batch(8, seed=0), random_batch(8, seed=1)


@pytest.fixture(scope="module")
def references(model_path, batches) -> dict[str, Any]:
    batch = batches[0]
    return {
        "language_model": reference_step(model_path, batch, OPTIM, "language_model"),
        "value_model": reference_step(model_path, batch, OPTIM, "value_model", seed=42),
    }


@pytest.fixture(scope="module", params=STAGES, ids=[f"zero{s}" for s in STAGES])
def stage_run(request, model_path, batches, tmp_path_factory) -> tuple[int, list[dict[str, Any]]]:
    ckpt = str(tmp_path_factory.mktemp(f"ds_ckpt{request.param}") / "ckpt")
    results = run_distributed(
        _stage_run, WORLD, request.param, model_path, *batches, ckpt, env=ENV, timeout=400
    )
    return request.param, results, ckpt


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


# ------------------------------------------------------------------------------ distributed tests
def test_forward_matches_plain_model(stage_run, model_path, batches):
    from verl_trainer.models.loading import load_causal_lm

    _, results, _ = stage_run
    shard = rank_shard(batches[0], 0, WORLD)
    model = load_causal_lm(model_path, attn_implementation="sdpa").eval()
    with torch.no_grad():
        logits = model(input_ids=shard["input_ids"], attention_mask=shard["attention_mask"]).logits
    used = used_targets(shard)  # the LM head runs where outputs are used; 0 elsewhere
    want = padded_log_probs(logits, shard["input_ids"]) * used
    probs = torch.softmax(logits.float(), -1)
    ent = -(probs * torch.log_softmax(logits.float(), -1)).sum(-1)
    want_ent = torch.cat([ent.new_zeros(ent.shape[0], 1), ent[:, :-1]], 1) * shard["attention_mask"]
    want_ent = want_ent * used
    got = results[0]["forward"]
    assert relative_error(got["log_probs"], want) < 1e-5
    assert relative_error(got["entropy"], want_ent) < 1e-5


@pytest.mark.parametrize("model_type", ["language_model", "value_model"])
def test_train_step_matches_plain_pytorch(stage_run, references, model_type):
    _, results, _ = stage_run
    key = "lm" if model_type == "language_model" else "value"
    ref = references[model_type]
    for r in results:  # every rank reports the same global loss and grad norm
        step = r[f"{key}_step"]
        assert _rel(step["loss"], ref["losses"][0]) < 1e-5
        assert _rel(step["grad_norm"], ref["grad_norms"][0]) < 1e-5
        assert step["num_micro_batches"] == 2 and not step["step_skipped"]
        assert step["lr"] == pytest.approx(OPTIM.lr)
    assert_close_params(results[0][f"{key}_params"], ref["params"], rtol=1e-5)


def test_gradients_are_reduced_only_after_the_last_micro_batch(stage_run):
    _, results, _ = stage_run
    *at_loss, after_step = results[0]["reductions"]
    assert len(at_loss) == 2
    assert at_loss[0] == at_loss[-1], "a gradient reduction ran before the last micro-batch"
    assert after_step > at_loss[-1]


@pytest.mark.parametrize("model_type", ["language_model", "value_model"])
def test_exported_params_load_into_plain_transformers_model(stage_run, model_path, model_type):
    from verl_trainer.models.loading import load_causal_lm, load_value_model

    _, results, _ = stage_run
    key = "lm" if model_type == "language_model" else "value"
    plain = load_causal_lm(model_path) if model_type == "language_model" else load_value_model(model_path)
    exported = results[0][f"{key}_params"]
    plain.load_state_dict(exported, strict=True)
    for name, value in plain.state_dict().items():
        assert value.shape == exported[name].shape and torch.equal(value, exported[name])


def test_save_load_step_equals_step_step(stage_run):
    stage, results, _ = stage_run
    for r in results:
        assert r["meta"]["global_step"] == 1 and r["meta"]["zero_stage"] == stage
        cont, resumed = r["continued_step"], r["resumed_step"]
        for key in ("loss", "grad_norm", "lr", "lr_after"):
            assert cont[key] == resumed[key], key
    r0 = results[0]
    assert torch.equal(r0["rng_after_save"], r0["rng_after_load"])
    cont, resumed = r0["continued_params"], r0["resumed_params"]
    assert cont.keys() == resumed.keys()
    assert all(torch.equal(cont[k], resumed[k]) for k in cont)
    assert any(not torch.equal(cont[k], r0["lm_params"][k]) for k in cont)  # the step did change them


def test_inference_only_engine_forward_and_checkpoint(stage_run):
    _, results, _ = stage_run
    r0 = results[0]
    assert torch.equal(r0["ref_forward"], r0["forward"]["log_probs"])
    assert r0["ref_meta"]["global_step"] == 1
    assert r0["ref_params"].keys() == r0["lm_params"].keys()
    assert all(torch.equal(r0["ref_params"][k], v) for k, v in r0["lm_params"].items())


def test_checkpoint_layout_and_weights_only_files(stage_run):
    from verl_trainer.engine.deepspeed_checkpoint import weights_only_load

    stage, _, ckpt = stage_run
    root = Path(ckpt)
    assert not any(p.name.startswith(".") for p in root.parent.iterdir())  # no temporary dir left
    names = {p.name for p in (root / "deepspeed" / "state").iterdir()}
    model_files = {f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(WORLD)}
    assert names >= ({"mp_rank_00_model_states.pt"} if stage < 3 else model_files)
    assert names >= {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(WORLD)}
    assert {"meta.json", "extra_state_rank0.pt", "extra_state_rank1.pt"} <= {p.name for p in root.iterdir()}
    for file in root.rglob("*.pt"):
        weights_only_load(str(file), map_location="cpu")  # no arbitrary unpickling needed


def test_non_finite_grad_norm_skips_step(stage_run):
    _, results, _ = stage_run
    for r in results:
        assert r["nan_step"]["step_skipped"] and not math.isfinite(r["nan_step"]["grad_norm"])
    r0 = results[0]
    assert r0["skipped_steps"] == 1
    assert all(torch.equal(r0["params_after_nan"][k], v) for k, v in r0["resumed_params"].items())


def _ulysses_run(stage: int, model_path: str, batch: Any) -> dict[str, Any]:
    """sp=2 on 2 ranks (dp=1): both ranks hold the whole batch and each runs half of every packed row."""
    out: dict[str, Any] = {}
    for model_type, loss_fn in (("language_model", nll_loss), ("value_model", value_loss)):
        engine = build_engine(f"deepspeed_stage_{stage}", model_type, model_path, OPTIM,
                              micro_batch_size_per_gpu=4, ulysses_sequence_parallel_size=2)
        assert engine.get_data_parallel_size() == 1
        out[model_type] = _train(engine, batch, loss_fn)
        out[f"{model_type}_params"] = collect_params(engine)
        del engine
    return out


def test_ulysses_sequence_parallel_step_matches_plain_pytorch(model_path, batches, references):
    results = run_distributed(_ulysses_run, WORLD, 3, model_path, batches[0], env=ENV, timeout=400)
    for model_type, ref in references.items():
        for r in results:
            step = r[model_type]
            assert _rel(step["loss"], ref["losses"][0]) < 1e-5
            assert _rel(step["grad_norm"], ref["grad_norms"][0]) < 1e-5
            assert step["num_micro_batches"] == 2
        assert_close_params(results[0][f"{model_type}_params"], ref["params"], rtol=1e-5)


# ------------------------------------------------------------------------------ single-process tests
@pytest.mark.parametrize("model_type", ["language_model", "value_model"])
def test_registry_backend_and_aliases(model_type):
    from verl_trainer.engine.deepspeed import DeepSpeedEngine

    registered = set(EngineRegistry.registered())
    for backend in ("deepspeed", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3"):
        for device in ("cpu", "cuda"):
            assert (model_type, backend, device, None) in registered
        assert issubclass(EngineRegistry.get_engine_cls(model_type, backend), DeepSpeedEngine)
    cfg = EngineConfig(model_path="unused")
    assert EngineRegistry.new(model_type, "deepspeed_stage_3", cfg).config.zero_stage == 3
    assert EngineRegistry.new(model_type, "deepspeed", cfg, zero_stage=1).config.zero_stage == 1
    engine = EngineRegistry.new(model_type, "deepspeed_stage_1", cfg, OPTIM)
    assert engine.MODEL_TYPE == model_type and engine.backend == "deepspeed_stage_1"
    with pytest.raises(ValueError, match="presets zero_stage=3"):
        EngineRegistry.new(model_type, "deepspeed_stage_3", cfg, zero_stage=2)


def test_initialize_needs_a_process_group():
    engine = EngineRegistry.new("language_model", "deepspeed", EngineConfig(model_path="unused"))
    with pytest.raises(RuntimeError, match="needs an initialised process group"):
        engine.initialize()
