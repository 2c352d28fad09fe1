"""``algorithm.rollout.lora_sync``: resolved and checked when the algorithm's config is built (no model
loads): ``auto`` picks adapter only for vllm on an accelerator with LoRA on linear layers, ``adapter`` is
refused without LoRA, with another backend, with LoRA on parameters, or with a too small ``max_lora_rank``;
vLLM's rank rounding."""

import json

import pytest

from verl_trainer.algorithms.config import GRPOConfig
from verl_trainer.engine import EngineConfig
from verl_trainer.rollout import RolloutConfig
from verl_trainer.rollout.lora_sync import vllm_lora_rank


def _config(engine: EngineConfig, **rollout) -> GRPOConfig:
    from verl_trainer.algorithms.config import ActorConfig

    return GRPOConfig(model_path="m", actor=ActorConfig(engine=engine), rollout=RolloutConfig(n=2, **rollout))


@pytest.mark.parametrize(("engine", "rollout", "want"), [
    (EngineConfig(), {"name": "vllm"}, "merged"),
    (EngineConfig(lora_rank=4), {"name": "vllm"}, "merged"),  # on CPU (vLLM's LoRA halves generation)
    (EngineConfig(lora_rank=4), {"name": "hf"}, "merged"),
    (EngineConfig(lora_rank=4), {"name": "auto"}, "merged"),
    (EngineConfig(lora_rank=4, target_parameters=["mlp.experts.down_proj"]), {"name": "vllm"}, "merged"),
    (EngineConfig(lora_rank=4), {"name": "vllm", "lora_sync": "merged"}, "merged"),
])
def test_auto_resolves_where_adapters_are_served(engine, rollout, want):
    config = _config(engine, **rollout)
    assert config.rollout.lora_sync == want
    assert config.rollout.max_lora_rank == 0


def test_auto_picks_adapter_with_vllm_on_an_accelerator(monkeypatch):
    monkeypatch.setattr("verl_trainer.algorithms.rollout_lora.get_device_name", lambda: "cuda")
    config = _config(EngineConfig(lora_rank=4), name="vllm")
    assert (config.rollout.lora_sync, config.rollout.max_lora_rank) == ("adapter", 4)
    assert _config(EngineConfig(lora_rank=4), name="hf").rollout.lora_sync == "merged"


@pytest.mark.parametrize(("engine", "rollout", "match"), [
    (EngineConfig(), {"name": "vllm"}, "the actor has none.*lora_rank > 0"),
    (EngineConfig(lora_rank=4), {"name": "hf"}, "rollout.name='hf'.*name=vllm, or lora_sync=merged"),
    (EngineConfig(lora_rank=4, target_parameters=["mlp.experts.down_proj"]), {"name": "vllm"},
     "target_parameters.*lora_sync=merged"),
    (EngineConfig(lora_rank=16), {"name": "vllm", "max_lora_rank": 8}, "max_lora_rank=8 is below.*16"),
])
def test_adapter_is_refused_where_it_cannot_run(engine, rollout, match):
    with pytest.raises(ValueError, match=match):
        _config(engine, lora_sync="adapter", **rollout)


def test_bad_values_and_a_saved_adapters_rank(tmp_path):
    with pytest.raises(ValueError, match=r"lora_sync='full' is unknown; choose one of \('auto', 'merged'"):
        RolloutConfig(lora_sync="full")
    with pytest.raises(ValueError, match="max_lora_rank=-1 must be an int >= 0"):
        RolloutConfig(max_lora_rank=-1)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 12, "target_modules": "all-linear"}))
    config = _config(EngineConfig(lora_adapter_path=str(tmp_path)), name="vllm", lora_sync="adapter")
    assert (config.rollout.lora_sync, config.rollout.max_lora_rank) == ("adapter", 12)
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 12, 300, 512)] == [1, 8, 8, 16, 320, 512]
    with pytest.raises(ValueError, match="rank 600 exceeds vLLM's largest max_lora_rank 512"):
        vllm_lora_rank(600)
