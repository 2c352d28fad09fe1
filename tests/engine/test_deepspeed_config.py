"""The DeepSpeed config the engine generates (pure function; no deepspeed import, no ranks)."""

from __future__ import annotations

import pytest

from verl_trainer.engine.config import EngineConfig, OptimConfig
from verl_trainer.engine.deepspeed_config import build_deepspeed_config, deep_merge


def _build(optim: OptimConfig | None = None, device: str = "cpu", world: int = 2, **cfg) -> dict:
    return build_deepspeed_config(EngineConfig(model_path="m", **cfg), optim, world, device)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_generated_config_drives_micro_batches_itself(stage):
    ds = _build(OptimConfig(clip_grad=0.5), zero_stage=stage, micro_batch_size_per_gpu=3)
    assert ds["zero_optimization"]["stage"] == stage
    assert ds["gradient_accumulation_steps"] == 1  # the engine loops; DeepSpeed never rescales the loss
    assert ds["train_micro_batch_size_per_gpu"] == 3 and ds["train_batch_size"] == 6
    assert ds["gradient_clipping"] == 0.5
    assert ds["bf16"] == {"enabled": False} and ds["fp16"] == {"enabled": False}
    assert "optimizer" not in ds and "scheduler" not in ds


def test_clipping_disabled_and_inference_only():
    assert _build(OptimConfig(clip_grad=None))["gradient_clipping"] == 0.0
    assert _build(None)["gradient_clipping"] == 0.0


def test_mixed_precision_sections():
    ds = _build(OptimConfig(), param_dtype="bf16", reduce_dtype="float32")
    assert ds["bf16"] == {"enabled": True} and ds["fp16"] == {"enabled": False}
    assert ds["communication_data_type"] == "fp32"
    assert "communication_data_type" not in _build(OptimConfig(), param_dtype="bf16", reduce_dtype="bf16")


def test_offload_maps_to_deepspeed_offload_off_cpu_only():
    cuda = _build(OptimConfig(), device="cuda", zero_stage=3, param_offload=True, optimizer_offload=True)
    assert cuda["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert cuda["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert cuda["zero_force_ds_cpu_optimizer"] is False
    cpu = _build(OptimConfig(), device="cpu", zero_stage=3, param_offload=True, optimizer_offload=True)
    assert "offload_param" not in cpu["zero_optimization"]
    with pytest.raises(ValueError, match="param_offload=True needs zero_stage=3"):
        _build(OptimConfig(), device="cuda", zero_stage=2, param_offload=True)


def test_raw_deepspeed_config_is_merged():
    raw = {"zero_optimization": {"overlap_comm": False, "reduce_bucket_size": 1000}, "steps_per_print": 5}
    ds = _build(OptimConfig(), zero_stage=2, deepspeed_config=raw)
    assert ds["zero_optimization"] == {"stage": 2, "overlap_comm": False, "reduce_bucket_size": 1000}
    assert ds["steps_per_print"] == 5


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"gradient_accumulation_steps": 4}, "gradient_accumulation_steps=4 is not supported"),
        ({"optimizer": {"type": "AdamW"}}, r"may not set \['optimizer'\]"),
        ({"scheduler": {"type": "WarmupLR"}}, r"may not set \['scheduler'\]"),
        ({"zero_optimization": {"stage": 3}}, "contradicts EngineConfig.zero_stage=2"),
    ],
)
def test_raw_config_that_breaks_the_contract_is_rejected(raw, match):
    with pytest.raises(ValueError, match=match):
        _build(OptimConfig(), zero_stage=2, deepspeed_config=raw)


def test_deep_merge_does_not_mutate():
    base = {"a": {"b": 1, "c": 2}, "d": 3}
    out = deep_merge(base, {"a": {"b": 5}, "e": 6})
    assert out == {"a": {"b": 5, "c": 2}, "d": 3, "e": 6}
    assert base == {"a": {"b": 1, "c": 2}, "d": 3}
