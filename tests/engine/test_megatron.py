"""The Megatron-Core engine (``strategy="megatron"``) on real gloo ranks, against transformers and fsdp2.

One 2-rank spawn (:func:`megatron_run`) runs every multi-rank check on a tiny Qwen2 (the default recipe's
architecture; the invariance matrix covers the tiny Llama): the HF import (log-probs / logits vs
transformers) and export (bitwise) at dp=2 and tp=2, one training step at dp=2 and at tp=2 against fsdp2 at
dp=2 on the same HF weights, and save -> load -> step equal to step -> step at both layouts. The refusals
run in the test process (they come before any process group is needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from verl_trainer.engine import EngineConfig, EngineRegistry, OptimConfig  # noqa: E402
from verl_trainer.engine.megatron_checkpoint import MEGATRON_SUBDIR  # noqa: E402
from verl_trainer.engine.megatron_model import SUPPORTED_ARCHITECTURES, check_hf_config  # noqa: E402
from verl_trainer.models.loading import load_causal_lm  # noqa: E402
from verl_trainer.models.tiny import make_tiny_model  # noqa: E402
from verl_trainer.testing.ranks import run_distributed  # noqa: E402
from verl_trainer.utils.safe_load import safe_torch_load  # noqa: E402

from .common import (  # noqa: E402
    build_engine,
    collect_params,
    nll_loss,
    padded_log_probs,
    random_batch,
    rank_shard,
    relative_error,
    used_targets,
)

pytestmark = pytest.mark.megatron

WORLD = 2
OPTIM = OptimConfig(lr=1.0, eps=1.0, weight_decay=0.0, clip_grad=1.0)
"""AdamW whose first step is ``-lr * g / (|g| + 1)``: linear in the gradient, so the updated parameters
measure it (Qwen2's k_proj bias has a zero true gradient: with eps=1e-8 its round-off would become ±lr)."""
RESUME_OPTIM = OptimConfig(lr=1e-2, weight_decay=0.01, clip_grad=1.0, lr_scheduler="cosine",
                           total_training_steps=4)
LAYOUTS = {"dp2": {}, "tp2": {"tensor_model_parallel_size": 2}}


@pytest.fixture(scope="module")
def qwen2_path(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("megatron") / "qwen2", arch="qwen2", hidden_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, seed=3)


@pytest.fixture(scope="module")
def batches() -> list:
    return [random_batch(8, seed=s) for s in (0, 1)]


# ------------------------------------------------------------------------------------ rank bodies
def _shard(batch, layout: str):
    """dp=2: this rank's half; tp=2 (dp=1): every TP rank holds the whole batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return batch if layout == "tp2" else rank_shard(batch, rank, world)


def _import_export(model_path: str, batch, layout: str, out_dir: str) -> dict[str, Any]:
    engine = build_engine("megatron", "language_model", model_path, None, micro_batch_size_per_gpu=4,
                          **LAYOUTS[layout])
    with engine.eval_mode():
        log_probs = engine.infer_batch(_shard(batch, layout))["model_output"]["log_probs"]
    logits = None
    if layout == "dp2":  # the raw logits of GPTModel itself, [b, s, V] at tp=1
        ids = batch["input_ids"][:2]
        width = ids.shape[1]
        causal = torch.triu(torch.ones(width, width, dtype=torch.bool), 1)[None, None]
        with torch.no_grad():
            logits = engine.gpt_model(ids, torch.arange(width).expand(2, -1), causal)
    exported = collect_params(engine)
    engine.save_hf(str(Path(out_dir) / f"hf_{layout}"))
    return {"log_probs": log_probs, "logits": logits, "exported": exported if dist.get_rank() == 0 else None}


def _train(backend: str, model_path: str, batch, layout: str) -> dict[str, Any]:
    engine = build_engine(backend, "language_model", model_path, OPTIM, micro_batch_size_per_gpu=2,
                          **LAYOUTS[layout])
    with engine.train_mode():
        out = engine.train_batch(_shard(batch, layout), nll_loss)
    return {"loss": out["loss"], "grad_norm": out["grad_norm"], "params": collect_params(engine)}


def _resume(model_path: str, batches: list, layout: str, ckpt: str) -> dict[str, Any]:
    """step, save, step on one engine; a fresh engine loads the save and steps: bitwise the same?"""
    shards = [_shard(b, layout) for b in batches]
    a = build_engine("megatron", "language_model", model_path, RESUME_OPTIM, micro_batch_size_per_gpu=2,
                     **LAYOUTS[layout])
    a.train_batch(shards[0], nll_loss)
    a.lr_scheduler_step()
    a.save_checkpoint(ckpt, global_step=1)
    torch.manual_seed(1234)
    b = build_engine("megatron", "language_model", model_path, RESUME_OPTIM, micro_batch_size_per_gpu=2,
                     **LAYOUTS[layout])
    meta = b.load_checkpoint(ckpt)
    b.apply_optim_config()
    results = [engine.train_batch(shards[1], nll_loss) for engine in (a, b)]
    for engine in (a, b):
        engine.lr_scheduler_step()
    pa, pb = collect_params(a), collect_params(b)
    return {"exact": pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa),
            "losses": [r["loss"] for r in results], "grad_norms": [r["grad_norm"] for r in results],
            "lrs": (a.get_lr(), b.get_lr()), "meta": meta}


def megatron_run(model_path: str, batches: list, out_dir: str) -> dict[str, Any]:
    """Every multi-rank check, on each of the two ranks."""
    result: dict[str, Any] = {}
    for layout in LAYOUTS:
        result[f"io_{layout}"] = _import_export(model_path, batches[0], layout, out_dir)
        result[f"train_{layout}"] = _train("megatron", model_path, batches[0], layout)
        ckpt = str(Path(out_dir) / f"ckpt_{layout}")
        result[f"resume_{layout}"] = _resume(model_path, batches, layout, ckpt)
    result["train_fsdp2"] = _train("fsdp2", model_path, batches[0], "dp2")
    return result


@pytest.fixture(scope="module")
def run(qwen2_path, batches, tmp_path_factory) -> list[dict[str, Any]]:
    out_dir = str(tmp_path_factory.mktemp("megatron_run"))
    results = run_distributed(megatron_run, WORLD, qwen2_path, batches, out_dir, timeout=600)
    for r in results:
        r["out_dir"] = out_dir
    return results


# ------------------------------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def hf_model(qwen2_path):
    return load_causal_lm(qwen2_path, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_import_matches_transformers(run, hf_model, batches, layout):
    batch = batches[0]
    with torch.no_grad():
        want = padded_log_probs(hf_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
                                         ).logits, batch["input_ids"]) * used_targets(batch)
    got = torch.cat([run[0][f"io_{layout}"]["log_probs"], run[1][f"io_{layout}"]["log_probs"]]) \
        if layout == "dp2" else run[0][f"io_{layout}"]["log_probs"]
    assert relative_error(got * used_targets(batch), want) < 1e-6
    if layout == "tp2":  # both TP ranks return the same outputs
        assert torch.equal(run[0]["io_tp2"]["log_probs"], run[1]["io_tp2"]["log_probs"])
    else:
        ids = batch["input_ids"][:2]
        with torch.no_grad():
            logits = hf_model(input_ids=ids).logits
        assert float((run[0]["io_dp2"]["logits"][..., :logits.shape[-1]] - logits).abs().max()) < 1e-5


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_export_is_exact(run, hf_model, layout):
    want = hf_model.state_dict()
    got = run[0][f"io_{layout}"]["exported"]
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    saved = AutoModelForCausalLM.from_pretrained(Path(run[0]["out_dir"]) / f"hf_{layout}").state_dict()
    assert all(torch.equal(saved[k], want[k]) for k in want)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_train_step_equals_fsdp2(run, layout):
    want, got = run[0]["train_fsdp2"], run[0][f"train_{layout}"]
    assert abs(got["loss"] - want["loss"]) <= 1e-6 * abs(want["loss"])
    assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-6 * want["grad_norm"]
    assert all(r[f"train_{layout}"]["grad_norm"] == got["grad_norm"] for r in run)  # the same on every rank
    for name, value in want["params"].items():
        if name.endswith("k_proj.bias"):  # zero true gradient: only round-off moves it
            assert float((got["params"][name] - value).abs().max()) < 1e-6, name
        else:
            assert relative_error(got["params"][name], value) < 1e-6, name


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_save_load_step_equals_step_step(run, layout):
    for r in run:
        resume = r[f"resume_{layout}"]
        assert resume["exact"], "the resumed engine's next step differs"
        assert resume["losses"][0] == resume["losses"][1]
        assert resume["grad_norms"][0] == resume["grad_norms"][1]
        assert resume["lrs"][0] == resume["lrs"][1]
        assert resume["meta"]["global_step"] == 1 and resume["meta"]["backend"] == "megatron"
        assert resume["meta"]["tensor_model_parallel_size"] == (2 if layout == "tp2" else 1)
    files = sorted((Path(run[0]["out_dir"]) / f"ckpt_{layout}" / MEGATRON_SUBDIR).iterdir())
    assert [f.name for f in files] == ["rank_0.pt", "rank_1.pt"]
    state = safe_torch_load(files[0])  # weights_only: tensors and plain data only
    assert set(state) == {"model", "optimizer"}


# ---------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("model_type", "overrides", "match"),
    [
        ("value_model", {}, r"language models only.*value head.*strategy='fsdp2'"),
        ("language_model", {"lora_rank": 4}, r"LoRA is not supported by the megatron engine.*lora_rank=0"),
        ("language_model", {"ulysses_sequence_parallel_size": 2},
         r"ulysses_sequence_parallel_size=2 .*fsdp2"),
        ("language_model", {"pipeline_model_parallel_size": 2}, r"pipeline_model_parallel_size=2 .*megatron"),
        ("language_model", {"param_offload": True}, r"param_offload is not supported by the megatron engine"),
        ("language_model", {"param_dtype": "bfloat16"}, r"param_dtype='bfloat16' differs .*'32-true'"),
        ("language_model", {"param_dtype": "float16"}, r"float16 .* not supported by the megatron engine"),
        ("language_model", {"enable_gradient_checkpointing": True}, r"does not run on CPU"),
    ],
)
def test_refusals_at_construction(qwen2_path, model_type, overrides, match):
    with pytest.raises(ValueError, match=match):
        EngineRegistry.new(model_type, "megatron", EngineConfig(model_path=qwen2_path, **overrides), OPTIM)


def test_refuses_a_model_factory_and_a_missing_path(qwen2_path):
    with pytest.raises(ValueError, match=r"not from a model factory; save the model with save_pretrained"):
        EngineRegistry.new("language_model", "megatron", EngineConfig(model_path=qwen2_path), OPTIM,
                           model_factory=lambda: load_causal_lm(qwen2_path))
    with pytest.raises(ValueError, match=r"needs EngineConfig.model_path"):
        EngineRegistry.new("language_model", "megatron", EngineConfig(), OPTIM)


def test_refuses_other_architectures_and_settings(qwen2_path):
    config = AutoConfig.from_pretrained(qwen2_path)
    for arch in SUPPORTED_ARCHITECTURES:
        check_hf_config(AutoConfig.for_model(arch, num_attention_heads=4, num_key_value_heads=2,
                                             intermediate_size=64, hidden_size=32), 2, "cpu")
    with pytest.raises(ValueError,
                       match=r"builds \('llama', 'qwen2', 'qwen3_moe'\) models, got model_type='gpt2'"):
        check_hf_config(AutoConfig.for_model("gpt2"), 1, "cpu")
    with pytest.raises(ValueError, match=r"num_key_value_heads=2 .*parallel_size=4; .*\[1, 2\]"):
        check_hf_config(config, 4, "cpu")
    config.attention_dropout = 0.1
    with pytest.raises(ValueError, match=r"no-op RNG tracker.*dropout 0.1"):
        check_hf_config(config, 1, "cpu")
    check_hf_config(config, 1, "cuda")  # Megatron's CUDA RNG tracker runs dropout
