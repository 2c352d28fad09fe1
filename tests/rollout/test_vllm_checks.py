"""``algorithm.rollout.name=vllm`` fails before any model loads, naming the value and the fix: vllm missing
(runs in the main venv, where vllm is not installed), an architecture vLLM lacks, a head size vLLM's CPU
attention refuses, ``tensor_parallel_size != 1`` (those need vllm: the ``vllm`` marker). The recipe case
runs the GRPO recipe in this process, where the check comes before the warm start's SFT."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.recipes.test_early_errors import _args, _no_model_loaded, run_in_process
from verl_trainer.data.tasks import ArithmeticTaskConfig, write_arithmetic_task
from verl_trainer.models.tiny import make_tiny_model
from verl_trainer.rollout import (
    AUTO_CPU_VLLM_MIN_PARAMS,
    BaseRollout,
    HFRollout,
    RolloutConfig,
    build_rollout,
    check_vllm_rollout,
    decoder_params,
    resolve_rollout_name,
    vllm_available,
)
from verl_trainer.rollout.vllm_support import generation_eos_ids

needs_vllm = pytest.mark.skipif(not vllm_available(), reason="needs the vllm extra")


@pytest.fixture(scope="module")
def head16(tmp_path_factory) -> str:
    """The demo's shape: hidden 64 / 4 heads = head size 16."""
    base = tmp_path_factory.mktemp("vllm_checks")
    return make_tiny_model(base / "h16", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, seed=0)


@pytest.mark.skipif(vllm_available(), reason="vllm is installed here")
def test_vllm_missing_names_the_extra(head16):
    with pytest.raises(ImportError, match=r"EXTRAS=vllm bash scripts/setup_venv.sh.*rollout.name=hf"):
        build_rollout(RolloutConfig(name="vllm"), head16)
    assert "vllm" not in sys.modules


@pytest.mark.vllm
@needs_vllm
def test_unsupported_head_size_architecture_and_tp(head16, tmp_path):
    with pytest.raises(ValueError, match=r"head size 16 .* takes head sizes \[32, 64.*num_attention_heads=2"):
        build_rollout(RolloutConfig(name="vllm"), head16)
    odd = Path(tmp_path / "odd")
    odd.mkdir()
    config = json.loads((Path(head16) / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchModelForCausalLM"]}))
    with pytest.raises(ValueError, match=r"architectures=\['NoSuchModelForCausalLM'\] is not a model vLLM"):
        check_vllm_rollout(odd)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: .* Set .*tensor_parallel_size=1"):
        check_vllm_rollout(head16, tensor_parallel_size=2)


@pytest.mark.vllm
@needs_vllm
def test_recipe_refuses_the_head_size_before_the_warm_start(tmp_path, monkeypatch, capfd):
    assets = tmp_path / "assets"
    make_tiny_model(assets / "model", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, seed=1)
    task = ArithmeticTaskConfig(num_train=64, num_val=4, holdout_fraction=0.2)
    write_arithmetic_task(assets / "data", task)
    argv = _args(assets, tmp_path / "run", "algorithm.rollout.name=vllm", "warm_start.enable=true",
                 f"warm_start.output={tmp_path / 'ws'}")
    with pytest.raises(ValueError, match="head size 16"):
        run_in_process("grpo", argv, monkeypatch)
    _no_model_loaded(capfd)
    assert not (tmp_path / "ws").exists()


@pytest.mark.vllm
@needs_vllm
def test_auto_picks_vllm_on_cuda_or_for_large_models(head16, tmp_path):
    head32 = make_tiny_model(tmp_path / "h32", hidden_size=64, num_attention_heads=2, num_key_value_heads=1)
    auto = RolloutConfig(name="auto", max_new_tokens=128)
    assert resolve_rollout_name(auto, head32) == ("vllm" if torch.cuda.is_available() else "hf")
    large = Path(tmp_path / "large")  # only config.json is read: 12 * 24 * 896**2 = 231M decoder parameters
    large.mkdir()
    config = json.loads((Path(head32) / "config.json").read_text())
    (large / "config.json").write_text(json.dumps({**config, "hidden_size": 896, "num_hidden_layers": 24,
                                                   "num_attention_heads": 14, "num_key_value_heads": 2}))
    assert decoder_params(large) >= AUTO_CPU_VLLM_MIN_PARAMS > decoder_params(head32)
    assert resolve_rollout_name(auto, large) == "vllm"
    assert resolve_rollout_name(auto, None) == "hf"
    assert resolve_rollout_name(RolloutConfig(name="vllm"), head16) == "vllm"  # as asked (then refused)
    assert resolve_rollout_name(RolloutConfig(name="hf"), large) == "hf"


def test_the_vllm_rollout_ends_turns_on_the_eos_ids_hf_generate_stops_on(tmp_path):
    """``generation_eos_ids`` (what VLLMRollout adds to the tokenizer's eos) reads
    ``generation_config.json``, else ``config.json``, as ``from_pretrained`` does for the HF rollout: the
    two cut turns on the same ids."""
    path = Path(make_tiny_model(tmp_path / "m", hidden_size=32, num_hidden_layers=1, seed=0))
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2, 7]}))
    assert generation_eos_ids(path) == [2, 7]
    hf = HFRollout(RolloutConfig(device="cpu"), str(path))
    assert hf.eos_token_ids == BaseRollout._eos_ids(hf.tokenizer, generation_eos_ids(path)) == [2, 7]
    (path / "generation_config.json").unlink()
    assert generation_eos_ids(path) == [json.loads((path / "config.json").read_text())["eos_token_id"]]
