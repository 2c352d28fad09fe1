"""Pipeline parallelism (fsdp2 stages on a (pp, dp) mesh) on real gloo ranks vs. a single-process step.

Default CI: the bad-input checks and the stage split (no spawn). The engine steps, export and checkpoints
are ``slow`` (dp=1 x pp=2 with dynamic micro-batches runs by default in the invariance slice).
"""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch
import torch.distributed as dist

from verl_trainer.data.packing import pack_batch
from verl_trainer.engine import EngineConfig, EngineRegistry
from verl_trainer.engine.pipeline_stage import check_pipeline_compatible, make_stage, pad_packed, stage_layers
from verl_trainer.models.attention import VARLEN_ATTENTION, packed_forward
from verl_trainer.models.loading import load_causal_lm
from verl_trainer.testing.ranks import run_distributed

from .common import (
    OPTIM,
    VALUE_OPTIM,
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

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"))


# ----------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pipeline_model_parallel_size": 0}, "pipeline_model_parallel_size must be an int >= 1"),
        ({"pipeline_model_parallel_size": 2, "tensor_model_parallel_size": 2},
         r"pipeline_model_parallel_size=2 with tensor_model_parallel_size=2 is not supported"),
        ({"pipeline_model_parallel_size": 2, "ulysses_sequence_parallel_size": 2},
         r"pipeline_model_parallel_size=2 with ulysses_sequence_parallel_size=2 is not supported"),
        ({"pipeline_model_parallel_size": 2, "lora_rank": 4}, r"pipeline_model_parallel_size=2 with LoRA"),
        ({"pipeline_model_parallel_size": 2, "param_offload": True},
         r"with param_offload .* param_offload=False"),
        ({"pipeline_model_parallel_size": 2, "enable_gradient_checkpointing": True},
         r"with enable_gradient_checkpointing"),
    ],
)
def test_config_refuses_unsupported_combinations(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("backend", ["fsdp"] + (["deepspeed"] if HAS_DEEPSPEED else []))
def test_other_backends_refuse_pp_at_construction(backend):
    with pytest.raises(ValueError, match=r"pipeline_model_parallel_size=2 .*strategy='fsdp2'"):
        EngineRegistry.new("language_model", backend, EngineConfig(pipeline_model_parallel_size=2), None)


def test_stage_layers_are_contiguous_and_balanced():
    assert [list(stage_layers(8, 2, s)) for s in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [list(stage_layers(7, 3, s)) for s in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [len(stage_layers(2, 2, s)) for s in range(2)] == [1, 1]


def test_models_the_split_cannot_run_are_refused(model_path):
    config = load_causal_lm(model_path).config
    check_pipeline_compatible(config, 2)
    with pytest.raises(ValueError, match=r"at least 3 decoder layers, .*num_hidden_layers=2"):
        check_pipeline_compatible(config, 3)
    config.tie_word_embeddings = True
    with pytest.raises(ValueError, match=r"tie_word_embeddings=True is not supported"):
        check_pipeline_compatible(config, 2)
    check_pipeline_compatible(config, 2, causal_lm=False)  # a value model's score head is never tied
    config.tie_word_embeddings, config.layer_types = False, ["full_attention", "sliding_attention"]
    with pytest.raises(ValueError, match=r"mixed layer_types"):
        check_pipeline_compatible(config, 2)


def test_stages_keep_hf_names_and_padding_does_not_change_outputs(model_path):
    """Two stages chained by hand on one process equal the whole model; the pad segment changes nothing."""
    whole = load_causal_lm(model_path, attn_implementation=VARLEN_ATTENTION)
    batch = random_batch(4, seed=5)
    packed = pack_batch(batch, keys=())
    with torch.no_grad():
        want = packed_forward(whole, packed).logits
    stages = [load_causal_lm(model_path, attn_implementation=VARLEN_ATTENTION) for _ in range(2)]
    forwards = [make_stage(m, s, 2) for s, m in enumerate(stages)]
    names = [set(m.state_dict()) for m in stages]
    assert names[0] | names[1] == set(whole.state_dict()) and not names[0] & names[1]
    assert "model.layers.1.mlp.up_proj.weight" in names[1] and "lm_head.weight" in names[1]
    assert "model.embed_tokens.weight" in names[0] - names[1] and "model.norm.weight" in names[1] - names[0]
    padded = pad_packed(packed, packed.num_tokens + 5)
    for forward in forwards:
        forward.batches = [padded]
    forwards[1].last_stage = lambda run, index: (packed_forward(run, padded).logits,)
    mb = torch.zeros(1, dtype=torch.long)
    with torch.no_grad():
        hidden = stages[0](padded.input_ids, mb=mb)
        (got,) = stages[1](hidden, mb=mb)
    torch.testing.assert_close(got[:, : packed.num_tokens], want, rtol=1e-6, atol=1e-6)


def _init_rank(model_path):
    try:
        build_engine("fsdp2", "language_model", model_path, None, pipeline_model_parallel_size=2)
    except ValueError as e:
        return str(e)
    return "built"


@pytest.mark.slow
def test_tied_model_is_refused_on_every_rank_before_loading(model_path, tmp_path):
    tied = tmp_path / "tied"
    shutil.copytree(model_path, tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    (tied / "model.safetensors").unlink()  # refused from config.json alone: the weights are never read
    out = run_distributed(_init_rank, 2, str(tied))
    assert all("tie_word_embeddings=True is not supported" in o for o in out), out


# --------------------------------------------------------------------------------- equivalence
def _pp_rank(model_path, batch, optim, pp, model_type, micro):
    engine = build_engine("fsdp2", model_type, model_path, optim, pipeline_model_parallel_size=pp, **micro)
    dp, dp_rank = engine.get_data_parallel_size(), engine.get_data_parallel_rank()
    shard = rank_shard(batch, dp_rank, dp)  # every stage of a DP rank holds the same samples
    out = {}
    loss_fn = nll_loss if model_type == "language_model" else value_loss
    with engine.eval_mode():  # forward only, with the loss (validation): GPipe's forward with the loss
        out["val_loss"] = engine.infer_batch(shard, loss_fn)["loss"]
        if model_type == "language_model":
            out["infer"] = engine.infer_batch(shard, calculate_entropy=True)["model_output"]
    with engine.train_mode():
        out["results"] = [engine.train_batch(shard, loss_fn) for _ in range(2)]
    topo = (dp, dp_rank, engine.topology.pp_rank, engine.is_mp_src_rank_with_outputs(),
            dist.get_world_size(engine.get_data_parallel_group()))
    local = sorted(engine.module.state_dict())
    return {**out, "params": collect_params(engine), "topo": topo, "local": local}


def _check_steps(out, ref):
    for rank_out in out:
        assert relative_error(torch.tensor(rank_out["val_loss"]), torch.tensor(ref["losses"][0])) < 1e-5
        last_stage = next(o for o in out if o["topo"][1] == rank_out["topo"][1] and o["topo"][3])
        for step, r in enumerate(rank_out["results"]):
            assert relative_error(torch.tensor(r["loss"]), torch.tensor(ref["losses"][step])) < 1e-5
            assert relative_error(torch.tensor(r["grad_norm"]), torch.tensor(ref["grad_norms"][step])) < 1e-5
            # every stage of a DP rank returns the last stage's per-micro-batch metrics
            assert r["metrics"] == last_stage["results"][step]["metrics"] and r["metrics"]
        assert_close_params(rank_out["params"], ref["params"])  # full tensors under the HF names


@pytest.mark.slow
def test_pp2_language_model_matches_plain_pytorch(model_path):
    """dp=1 x pp=2, dynamic micro-batches (1F1B): loss, grad norm, params, log-probs / entropy."""
    batch = random_batch(8)
    ref = reference_step(model_path, batch, OPTIM, steps=2)
    out = run_distributed(_pp_rank, 2, model_path, batch, OPTIM, 2, "language_model",
                          {"use_dynamic_bsz": True, "max_token_len_per_gpu": 40})
    assert [o["topo"] for o in out] == [(1, 0, 0, False, 1), (1, 0, 1, True, 1)]  # outputs: last stage
    assert "lm_head.weight" in out[1]["local"] and "lm_head.weight" not in out[0]["local"]
    assert "model.embed_tokens.weight" in out[0]["local"]
    assert "model.layers.1.mlp.up_proj.weight" in out[1]["local"]
    assert out[0]["results"][0]["num_micro_batches"] >= 2
    _check_steps(out, ref)
    assert list(out[0]["params"]) == list(load_causal_lm(model_path).state_dict())  # HF order on every rank
    model = load_causal_lm(model_path, attn_implementation="sdpa")
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    mask = batch["attention_mask"].bool().clone()
    mask[:, 0] = False
    mask &= used_targets(batch)
    want = padded_log_probs(logits, batch["input_ids"]) * mask
    for o in out:  # the same outputs on every stage (broadcast from the last)
        torch.testing.assert_close(o["infer"]["log_probs"], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o["infer"]["entropy"], out[1]["infer"]["entropy"], rtol=0, atol=0)


@pytest.mark.slow
def test_pp2_value_model_matches_plain_pytorch(model_path):
    batch = random_batch(8, seed=3)
    ref = reference_step(model_path, batch, VALUE_OPTIM, model_type="value_model", steps=2)
    out = run_distributed(_pp_rank, 2, model_path, batch, VALUE_OPTIM, 2, "value_model",
                          {"micro_batch_size_per_gpu": 3})
    _check_steps(out, ref)
    assert "score.weight" in out[1]["local"] and "score.weight" not in out[0]["local"]


@pytest.mark.slow
def test_pp2_dp2_matches_plain_pytorch(model_path):
    """4 ranks on a (pp=2, dp=2) mesh: stages dp ranks apart, FSDP over dp within each stage."""
    batch = random_batch(8)
    ref = reference_step(model_path, batch, OPTIM, steps=2)
    out = run_distributed(_pp_rank, 4, model_path, batch, OPTIM, 2, "language_model",
                          {"micro_batch_size_per_gpu": 1})
    assert [o["topo"] for o in out] == [(2, 0, 0, False, 2), (2, 1, 0, False, 2),
                                        (2, 0, 1, True, 2), (2, 1, 1, True, 2)]
    _check_steps(out, ref)


# ---------------------------------------------------------------------------------- checkpoints
def _ckpt_rank(model_path, batches, optim, ckpt, hf_dir):
    a = build_engine("fsdp2", "language_model", model_path, optim, micro_batch_size_per_gpu=2,
                     pipeline_model_parallel_size=2)
    a.train_batch(batches[0], nll_loss)
    a.save_checkpoint(ckpt, global_step=1)
    a.save_hf(hf_dir)
    saved = collect_params(a)
    b = build_engine("fsdp2", "language_model", model_path, optim, micro_batch_size_per_gpu=2,
                     pipeline_model_parallel_size=2)
    b.load_checkpoint(ckpt)
    for engine in (a, b):  # step -> step   vs   save -> load -> step, same layout
        engine.train_batch(batches[1], nll_loss)
    pa, pb = collect_params(a), collect_params(b)
    same_layout_exact = pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
    # into another layout: dp=2 x pp=1 (FSDP only), resharded by DCP
    c = build_engine("fsdp2", "language_model", model_path, optim, micro_batch_size_per_gpu=2)
    c.load_checkpoint(ckpt)
    pc = collect_params(c)
    resharded_exact = pc.keys() == saved.keys() and all(torch.equal(pc[k], saved[k]) for k in saved)
    c.train_batch(rank_shard(batches[1], dist.get_rank(), 2), nll_loss)  # the optimizer state came along
    return {"same": same_layout_exact, "reshard": resharded_exact, "after": collect_params(c), "pa": pa,
            "saved": saved}


@pytest.mark.slow
def test_pp_checkpoint_reloads_bitwise_and_into_another_layout_and_exports(model_path, tmp_path):
    batches = [random_batch(8, seed=s) for s in (10, 11)]
    hf_dir = tmp_path / "hf"
    out = run_distributed(_ckpt_rank, 2, model_path, batches, OPTIM, str(tmp_path / "ckpt"), str(hf_dir))
    for r in out:
        assert r["same"], "pp=2: save -> load -> step differs from step -> step"
        assert r["reshard"], "pp=2 checkpoint loaded into dp=2 differs from the saved weights"
        assert_close_params(r["after"], r["pa"])
    from verl_trainer.export.convert import convert_checkpoint

    converted = tmp_path / "converted"
    convert_checkpoint(tmp_path / "ckpt", converted)  # offline, one process, from the stages' DCP shards
    for directory in (hf_dir, converted):
        exported = load_causal_lm(directory).state_dict()
        assert exported.keys() == out[0]["saved"].keys()
        assert all(torch.equal(exported[k], out[0]["saved"][k]) for k in exported)


def _from_pp1_rank(model_path, batches, optim, ckpt):
    a = build_engine("fsdp2", "language_model", model_path, optim, micro_batch_size_per_gpu=2)
    a.train_batch(rank_shard(batches[0], dist.get_rank(), 2), nll_loss)
    a.save_checkpoint(ckpt, global_step=1)  # dp=2 x pp=1: grouped optimizer state
    a.train_batch(rank_shard(batches[1], dist.get_rank(), 2), nll_loss)
    b = build_engine("fsdp2", "language_model", model_path, optim, micro_batch_size_per_gpu=2,
                     pipeline_model_parallel_size=2)
    b.load_checkpoint(ckpt)
    b.train_batch(batches[1], nll_loss)  # dp=1 x pp=2: the same step
    return {"a": collect_params(a), "b": collect_params(b)}


@pytest.mark.slow
def test_pp1_checkpoint_resumes_into_pipeline_stages(model_path, tmp_path):
    batches = [random_batch(8, seed=s) for s in (10, 11)]
    out = run_distributed(_from_pp1_rank, 2, model_path, batches, OPTIM, str(tmp_path / "ckpt"))
    for r in out:
        assert_close_params(r["b"], r["a"])


def _bf16_rank(model_path, batch, pp):
    engine = build_engine("fsdp2", "language_model", model_path, OPTIM, micro_batch_size_per_gpu=2,
                          pipeline_model_parallel_size=pp, param_dtype="bfloat16")
    shard = batch if pp == 2 else rank_shard(batch, dist.get_rank(), 2)
    result = engine.train_batch(shard, nll_loss)
    return result["loss"], result["grad_norm"]


@pytest.mark.slow
def test_pp2_bf16_mixed_equals_dp2(model_path):
    """bf16 compute (stage-to-stage activations in bfloat16) gives the dp=2 run's loss and grad norm."""
    batch = random_batch(8)
    pp, dp = (run_distributed(_bf16_rank, 2, model_path, batch, size) for size in (2, 1))
    for got in pp:
        assert got[0] == pytest.approx(dp[0][0], rel=1e-5) and got[1] == pytest.approx(dp[0][1], rel=1e-5)
