"""LoRA engines (peft adapters before sharding): what trains, what is exported, the reference, checkpoints.

The fast test runs one 2-rank fsdp2 job and checks everything on it; the backend/batching invariance
matrix is in ``test_lora_invariance.py``.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict
from torch.distributed.checkpoint import FileSystemReader

from verl_trainer.engine import EngineConfig, EngineRegistry
from verl_trainer.engine.lora import apply_lora
from verl_trainer.engine.lora_export import lora_targets, merged_hf_tensors
from verl_trainer.models.loading import load_causal_lm
from verl_trainer.testing.ranks import run_distributed

from .common import (
    OPTIM,
    collect_params,
    nll_loss,
    padded_log_probs,
    random_batch,
    rank_shard,
    tiny_model,
    used_targets,
)

LORA = {"lora_rank": 4, "lora_alpha": 8.0, "target_modules": "all-linear"}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"))


def _peft(model_path: str, **overrides) -> PeftModel:
    base = load_causal_lm(model_path, attn_implementation="sdpa")
    config = LoraConfig(r=4, lora_alpha=8.0, target_modules="all-linear", task_type="CAUSAL_LM", **overrides)
    return get_peft_model(base, config, autocast_adapter_dtype=False)


# ------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("lora_rank", -1, "lora_rank must be an int >= 0"),
        ("lora_alpha", 0, "lora_alpha must be > 0"),
        ("lora_dropout", 1.0, r"lora_dropout must be in \[0, 1\)"),
        ("target_modules", "q_proj", "use 'all-linear' or a non-empty list"),
        ("target_modules", [], "use 'all-linear' or a non-empty list"),
        ("target_parameters", "mlp.experts.down_proj", "use null or a non-empty list"),
        ("target_parameters", [], "use null or a non-empty list"),
    ],
)
def test_config_rejects_bad_lora_values(field, value, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**{field: value})


def test_config_refuses_dropout_on_target_parameters():
    with pytest.raises(ValueError, match=r"lora_dropout=0.1 with target_parameters=\['mlp.experts.down"):
        EngineConfig(lora_rank=4, lora_dropout=0.1, target_parameters=["mlp.experts.down_proj"])


def test_config_lora_switch_and_list_targets():
    assert not EngineConfig().lora_enabled
    assert EngineConfig(lora_adapter_path="some/dir").lora_enabled
    config = EngineConfig(lora_rank=8, target_modules=("q_proj", "v_proj"))
    assert config.lora_enabled and config.target_modules == ["q_proj", "v_proj"]


# ------------------------------------------------------------------------------ building, no processes
def test_apply_lora_refuses_what_it_cannot_do(model_path, tmp_path):
    base = load_causal_lm(model_path)
    with pytest.raises(ValueError, match="not a peft adapter directory"):
        apply_lora(base, EngineConfig(lora_adapter_path=str(tmp_path)), "language_model")
    with pytest.raises(ValueError, match="only on linear layers"):
        apply_lora(base, EngineConfig(lora_rank=2, target_modules=["embed_tokens"]), "language_model")
    with pytest.raises(ValueError, match="it has adapters"):
        apply_lora(_peft(model_path), EngineConfig(lora_rank=2), "language_model")
    assert apply_lora(base, EngineConfig(), "language_model") is base


# ------------------------------------------------------------------------------ merge, no processes
def test_merged_stream_equals_merge_and_unload(model_path):
    """W + scale·B·A per tensor (nothing merged in place) equals peft's merge_and_unload weights."""
    model = _peft(model_path, init_lora_weights=False)  # random B: a non-zero delta everywhere
    before = {k: v.clone() for k, v in model.state_dict().items()}
    targets = lora_targets(model, "default")
    assert len(targets) == 2 * 7  # 2 layers x (q, k, v, o, gate, up, down)
    merged = dict(merged_hf_tensors(model.state_dict().items(), targets, "default"))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # not merged in place
    want = model.merge_and_unload().state_dict()
    assert sorted(merged) == sorted(want)
    for name, value in want.items():
        assert merged[name].shape == value.shape
        torch.testing.assert_close(merged[name], value, rtol=1e-6, atol=1e-6)
    base_names = {n: "base_model.model." + n.replace(".weight", ".base_layer.weight")
                  for n in want if "proj" in n}
    changed = [n for n, b in base_names.items() if not torch.equal(want[n], before[b])]
    assert len(changed) == len(targets)


# ------------------------------------------------------------------------------- one fsdp2 job
def _lora_rank(model_path: str, tmp: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = random_batch(8, seed=3)
    shard = rank_shard(batch, rank, world)
    config = EngineConfig(model_path=model_path, micro_batch_size_per_gpu=2, **LORA)
    engine = EngineRegistry.new("language_model", "fsdp2", config, OPTIM)
    engine.initialize()
    out: dict = {"trainable": engine.num_trainable_parameters()}
    opt_params = [p for group in engine.optimizer.param_groups for p in group["params"]]
    out["optimizer_params"] = len(opt_params)
    with engine.eval_mode(), engine.disable_adapters():
        out["ref_log_probs"] = engine.infer_batch(shard)["model_output"]["log_probs"]
    with engine.train_mode():
        out["losses"] = [engine.train_batch(shard, nll_loss)["loss"] for _ in range(2)]
    state = engine.optimizer.state
    out["optimizer_state_numel"] = sum(
        v.numel() for p in opt_params for v in state[p].values() if torch.is_tensor(v) and v.dim() > 0
    )
    with engine.eval_mode():
        out["log_probs"] = engine.infer_batch(shard)["model_output"]["log_probs"]
        with engine.disable_adapters():
            out["ref_after"] = engine.infer_batch(shard)["model_output"]["log_probs"]
    out["merged"] = collect_params(engine)
    out["adapters"] = collect_params_adapters(engine)
    engine.save_adapter(os.path.join(tmp, "adapter"))
    from_adapter = EngineRegistry.new(
        "language_model", "fsdp2",
        EngineConfig(model_path=model_path, lora_adapter_path=os.path.join(tmp, "adapter")), OPTIM,
    )
    from_adapter.initialize()
    out["merged_from_adapter"] = collect_params(from_adapter)
    out.update(_save_step_resume(engine, "fsdp2", config, shard, os.path.join(tmp, "ckpt")))
    return out


def _save_step_resume(engine, backend: str, config: EngineConfig, shard, ckpt: str) -> dict:
    """Save, take a step; a fresh engine loads the checkpoint and takes the same step."""
    engine.save_checkpoint(ckpt, global_step=2)
    out = {}
    with engine.train_mode():
        out["step3"] = engine.train_batch(shard, nll_loss)["loss"]
    out["after3"] = collect_params(engine)
    resumed = EngineRegistry.new("language_model", backend, config, OPTIM)
    resumed.initialize()
    resumed.load_checkpoint(ckpt)
    with resumed.train_mode():
        out["step3_resumed"] = resumed.train_batch(shard, nll_loss)["loss"]
    out["after3_resumed"] = collect_params(resumed)
    return out


def _assert_resumed_bitwise(out: dict) -> None:
    assert out["step3_resumed"] == out["step3"]
    for name, value in out["after3"].items():
        assert torch.equal(out["after3_resumed"][name], value), name


def collect_params_adapters(engine) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in engine.get_per_tensor_param(adapters_only=True)}


def test_lora_fsdp2_end_to_end(model_path, tmp_path):
    out = run_distributed(_lora_rank, 2, model_path, str(tmp_path))
    r0 = out[0]
    reference = _peft(model_path)
    lora_numel = sum(p.numel() for n, p in reference.named_parameters() if "lora_" in n)
    # 2 layers x r=4 x [(32+32) q, (32+16) k, (32+16) v, (32+32) o, 3 x (32+64) mlp] = 4,096
    assert r0["trainable"] == lora_numel == 4096
    assert r0["optimizer_params"] == 2 * 2 * 7  # A and B of 14 layers, nothing else
    assert r0["optimizer_state_numel"] == 2 * lora_numel  # exp_avg + exp_avg_sq of the adapters only
    assert r0["losses"][1] < r0["losses"][0]

    # reference = adapters disabled = the base model, before and after training
    base = load_causal_lm(model_path, attn_implementation="sdpa")
    batch = random_batch(8, seed=3)
    with torch.no_grad():
        logits = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    mask = batch["attention_mask"].bool() & used_targets(batch)  # the LM head runs only where used
    mask[:, 0] = False
    want = padded_log_probs(logits, batch["input_ids"]) * mask
    for key in ("ref_log_probs", "ref_after"):
        got = torch.cat([rank_out[key] for rank_out in out])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (r0["log_probs"] - r0["ref_after"]).abs().max() > 1e-3  # the adapters did change the policy

    # merged export = merge_and_unload of the saved adapter on the base model (HF names and shapes)
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    loaded = PeftModel.from_pretrained(load_causal_lm(model_path), str(tmp_path / "adapter"))
    assert sorted(get_peft_model_state_dict(loaded)) == sorted(r0["adapters"])
    merged_want = loaded.merge_and_unload().state_dict()
    assert sorted(r0["merged"]) == sorted(merged_want)
    for name, value in merged_want.items():
        torch.testing.assert_close(r0["merged"][name], value, rtol=1e-6, atol=1e-6)
    assert set(out[1]["merged"]) == set(r0["merged"])
    for name, value in r0["merged"].items():  # an engine started from the saved adapter (lora_adapter_path)
        assert torch.equal(r0["merged_from_adapter"][name], value), name

    # checkpoint: adapters + optimizer only, and the resumed step is bitwise the original
    saved = FileSystemReader(str(tmp_path / "ckpt" / "dcp")).read_metadata().state_dict_metadata
    saved_tensors = {k: v for k, v in saved.items() if hasattr(v, "size") and len(v.size) > 0}
    model_keys = {k.removeprefix("model.") for k in saved_tensors if k.startswith("model.")}
    assert model_keys == {k for k in reference.state_dict() if "lora_" in k}  # no frozen base weight
    saved_numel = sum(torch.Size(v.size).numel() for v in saved_tensors.values())
    assert saved_numel == 3 * lora_numel  # adapters + AdamW's two moments
    _assert_resumed_bitwise(r0)


def _deepspeed_resume_rank(model_path: str, zero_stage: int, ckpt: str) -> dict:
    config = EngineConfig(model_path=model_path, micro_batch_size_per_gpu=2, zero_stage=zero_stage, **LORA)
    engine = EngineRegistry.new("language_model", "deepspeed", config, OPTIM)
    engine.initialize()
    shard = rank_shard(random_batch(8, seed=3), dist.get_rank(), dist.get_world_size())
    with engine.train_mode():
        engine.train_batch(shard, nll_loss)
    return _save_step_resume(engine, "deepspeed", config, shard, ckpt)


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_lora_deepspeed_checkpoint_is_small_and_resumes_bitwise(zero_stage, model_path, tmp_path):
    pytest.importorskip("deepspeed")
    ckpt = tmp_path / "ckpt"
    out = run_distributed(_deepspeed_resume_rank, 2, model_path, zero_stage, str(ckpt),
                          env={"DS_ACCELERATOR": "cpu"}, timeout=600)
    for rank_out in out:
        _assert_resumed_bitwise(rank_out)
    saved = sum(f.stat().st_size for f in (ckpt / "deepspeed").rglob("*.pt"))
    base_bytes = sum(v.numel() * 4 for k, v in load_causal_lm(model_path).state_dict().items())
    # fp32 adapters x (weights + fp32 master + 2 AdamW moments) = 4 x 4,096 x 4 B = 64 KiB, plus
    # DeepSpeed's pickled bookkeeping; a full-model checkpoint would hold 4 x the base's 99.7 KB
    assert saved < 2 * base_bytes


# ------------------------------------------------------------------------------ a user's model
def build_user_peft_model(model_path: str) -> PeftModel:
    """What a user hands the engine: their own PeftModel (rank 2 on q and v only)."""
    base = load_causal_lm(model_path)
    config = LoraConfig(r=2, lora_alpha=4.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                        init_lora_weights=False)
    return get_peft_model(base, config, autocast_adapter_dtype=False)


def _factory_rank(model_path: str) -> dict:
    from verl_trainer.engine.config import EngineSpec
    from verl_trainer.training.strategy import Strategy

    spec = EngineSpec("language_model", EngineConfig(micro_batch_size_per_gpu=4), OPTIM,
                      model=functools.partial(build_user_peft_model, model_path))
    engine = Strategy("fsdp2").build_engines({"actor": spec}, "32-true", 7, "cpu")["actor"]
    with engine.eval_mode():
        log_probs = engine.infer_batch(random_batch(4, seed=1))["model_output"]["log_probs"]
    return {"trainable": engine.num_trainable_parameters(), "merged": collect_params(engine),
            "log_probs": log_probs, "attn": engine.peft_model.config._attn_implementation}


def test_engine_spec_model_factory_returning_a_peft_model(model_path):
    out = run_distributed(_factory_rank, 1, model_path)[0]
    torch.manual_seed(7)  # the engine seeds before calling the factory: the same random adapters
    user = build_user_peft_model(model_path)
    assert out["trainable"] == 2 * 2 * ((32 + 32) + (32 + 16)) == 448
    assert out["attn"] == "verl_varlen"  # switched to padding-free attention by the engine
    want = user.merge_and_unload().state_dict()
    assert sorted(out["merged"]) == sorted(want)
    for name, value in want.items():
        torch.testing.assert_close(out["merged"][name], value, rtol=1e-6, atol=1e-6)
    batch = random_batch(4, seed=1)
    with torch.no_grad():
        logits = user(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    mask = batch["attention_mask"].bool() & used_targets(batch)  # the LM head runs only where used
    mask[:, 0] = False
    torch.testing.assert_close(out["log_probs"], padded_log_probs(logits, batch["input_ids"]) * mask,
                               rtol=1e-5, atol=1e-5)


def test_engine_spec_model_must_be_callable():
    from verl_trainer.engine.config import EngineSpec

    with pytest.raises(TypeError, match="EngineSpec.model must be a callable"):
        EngineSpec("language_model", EngineConfig(), model="not a function")
