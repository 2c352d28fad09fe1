"""``engine.save_hf`` and ``python -m verl_trainer.export`` on 2 gloo ranks: the exported HF directory,
loaded with plain transformers, reproduces the engine's log-probs / values to 1e-5 (fp32).

One distributed run per case trains one step, exports with ``save_hf`` (small shards, so the model is
sharded), saves an engine checkpoint and records the engine's outputs on a batch. The test then loads the
export with ``AutoModelFor*.from_pretrained`` and converts the checkpoint on this one process; the converted
weights must equal the export's bit for bit. fsdp2 (language + value model) runs by default; fsdp1,
DeepSpeed ZeRO-1/2/3, Ulysses sp=2 and LoRA (the merged model; the converter refuses adapter-only
checkpoints) are ``slow``.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.engine.common import (
    build_engine,
    nll_loss,
    padded_log_probs,
    padded_values,
    random_batch,
    tiny_model,
    used_targets,
    value_loss,
)
from verl_trainer.engine import OptimConfig
from verl_trainer.export.convert import convert_checkpoint
from verl_trainer.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
OPTIM = OptimConfig(lr=1e-2, clip_grad=1.0)
SHARD = 40_000  # bytes: the tiny model (~150 kB) is written as several shards
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _export_run(backend: str, model_types: tuple[str, ...], model_path: str, out: str, batch, config: dict):
    """Per rank: one train step, save_hf, an engine checkpoint, the engine's outputs on the whole batch."""
    outputs = {}
    for model_type in model_types:
        engine = build_engine(backend, model_type, model_path, OPTIM, micro_batch_size_per_gpu=2, **config)
        dp, rank = engine.get_data_parallel_size(), engine.get_data_parallel_rank()
        n = batch.batch_size[0] // dp
        loss = nll_loss if model_type == "language_model" else value_loss
        with engine.train_mode():
            engine.train_batch(batch[rank * n:(rank + 1) * n], loss)
        engine.save_hf(Path(out) / model_type / "hf", max_shard_size=SHARD)
        engine.save_checkpoint(str(Path(out) / model_type / "ckpt"), global_step=1)
        with engine.eval_mode():
            outputs[model_type] = engine.infer_batch(batch)["model_output"]
    return outputs if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model(str(tmp_path_factory.mktemp("export_model") / "tiny"))


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def _check(out: Path, model_type: str, engine_out: dict, batch, cli: bool = False, lora: bool = False):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    hf = out / model_type / "hf"
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in hf.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    assert AutoTokenizer.from_pretrained(str(hf)).decode([4, 5]) == "01"
    mask = used_targets(batch)
    if model_type == "language_model":
        assert (hf / "generation_config.json").is_file()
        model = AutoModelForCausalLM.from_pretrained(str(hf))
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        got, want = padded_log_probs(logits, batch["input_ids"]), engine_out["log_probs"]
    else:
        model = AutoModelForTokenClassification.from_pretrained(str(hf))
        assert model.config.num_labels == 1
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        got, want = padded_values(logits), engine_out["values"]
        mask = batch["attention_mask"].bool()
        mask[:, 0] = False
    err = (got.detach() - want).abs()[mask].max().item()
    assert err < 1e-5, f"{model_type}: exported model differs from the engine by {err:.2e}"
    # one process, no distributed run: the converted weights equal the export's
    conv = out / model_type / "converted"
    if lora:  # the checkpoint holds the adapters only: the converter says to use save_hf
        with pytest.raises(ValueError, match="LoRA checkpoint.*save_hf"):
            convert_checkpoint(out / model_type / "ckpt", conv)
        return
    if cli:
        proc = subprocess.run([sys.executable, "-m", "verl_trainer.export", str(out / model_type / "ckpt"),
                               str(conv), "--max-shard-size", str(SHARD)],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        convert_checkpoint(out / model_type / "ckpt", conv, max_shard_size=SHARD)
    a, b = _tensors(hf), _tensors(conv)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert AutoTokenizer.from_pretrained(str(conv)).decode([4, 5]) == "01"


def _run_case(tmp_path, model_path, backend, model_types, env=None, cli=False, **config):
    batch = random_batch(8, seed=3)
    results = run_distributed(_export_run, 2, backend, model_types, model_path, str(tmp_path), batch, config,
                              env=env or {}, timeout=400)
    for model_type in model_types:
        _check(tmp_path, model_type, results[0][model_type], batch, cli=cli, lora="lora_rank" in config)


def test_fsdp2_export_reproduces_the_engine_language_and_value_model(tmp_path, model_path):
    _run_case(tmp_path, model_path, "fsdp2", ("language_model", "value_model"))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3"])
def test_export_reproduces_the_engine_each_backend(tmp_path, model_path, backend):
    if backend.startswith("deepspeed") and not HAS_DEEPSPEED:
        pytest.skip("needs deepspeed")
    env = {"DS_ACCELERATOR": "cpu"} if backend.startswith("deepspeed") else None
    _run_case(tmp_path, model_path, backend, ("language_model", "value_model"), env=env, cli=True)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed_stage_3"])
def test_export_under_ulysses_sequence_parallelism(tmp_path, model_path, backend):
    if backend.startswith("deepspeed") and not HAS_DEEPSPEED:
        pytest.skip("needs deepspeed")
    env = {"DS_ACCELERATOR": "cpu"} if backend.startswith("deepspeed") else None
    _run_case(tmp_path, model_path, backend, ("language_model",), env=env, ulysses_sequence_parallel_size=2)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed_stage_3"])
def test_lora_export_is_the_merged_model(tmp_path, model_path, backend):
    if backend.startswith("deepspeed") and not HAS_DEEPSPEED:
        pytest.skip("needs deepspeed")
    env = {"DS_ACCELERATOR": "cpu"} if backend.startswith("deepspeed") else None
    _run_case(tmp_path, model_path, backend, ("language_model", "value_model"), env=env, lora_rank=4,
              lora_alpha=8)
