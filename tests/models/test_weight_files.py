"""A truncated or damaged model.safetensors is named before any model loads (it was a deep reader error)."""

from __future__ import annotations

import pytest

from verl_trainer.models import load_causal_lm, make_tiny_model
from verl_trainer.models.weight_files import DamagedWeightsError, check_safetensors
from verl_trainer.recipe_config import ModelConfig
from verl_trainer.recipes.common import prepare_model


def test_a_truncated_weights_file_is_named_before_loading(tmp_path):
    path = make_tiny_model(tmp_path / "model", arch="llama", hidden_size=32, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, seed=0)
    weights = tmp_path / "model" / "model.safetensors"
    header = check_safetensors(weights)  # intact: every tensor's bytes are there
    assert "model.embed_tokens.weight" in header
    size = weights.stat().st_size
    with weights.open("r+b") as handle:
        handle.truncate(size - 100)
    with pytest.raises(DamagedWeightsError, match=rf"'{weights}' is damaged: it has {size - 100} bytes but "
                                                  rf"its tensors end at byte {size} \(100 bytes missing\)"):
        load_causal_lm(path)
    with pytest.raises(DamagedWeightsError, match="model.safetensors' is damaged"):  # the recipes: early
        prepare_model(ModelConfig(path=path, make_tiny_if_missing=False))
    weights.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(DamagedWeightsError, match="its header is not valid JSON"):
        load_causal_lm(path)
    weights.write_bytes(b"abc")
    with pytest.raises(DamagedWeightsError, match="fewer than a safetensors header"):
        load_causal_lm(path)
