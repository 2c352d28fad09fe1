"""The HF directory writer on one process: shards and index, tied weights once, names checked, sizes."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from verl_trainer.export import save_hf_model
from verl_trainer.models.safetensors_shards import parse_size
from verl_trainer.models.tiny import build_tokenizer
from verl_trainer.utils.fs import NotOwnedError


@pytest.fixture(scope="module")
def tied():
    config = AutoConfig.for_model("qwen2", vocab_size=len(build_tokenizer()), hidden_size=16,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                  intermediate_size=32, tie_word_embeddings=True)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def test_tied_weights_are_written_once_and_the_model_reloads_equal(tmp_path, tied):
    out = save_hf_model(tied.state_dict().items(), tmp_path / "hf", tied.config, tokenizer=build_tokenizer(),
                        max_shard_size="4KB", dtype=torch.bfloat16)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"] and "model.embed_tokens.weight" in index["weight_map"]
    files = sorted(p.name for p in (tmp_path / "hf").glob("model-*.safetensors"))
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors" and len(files) > 2
    assert not list((tmp_path / "hf").glob(".*tmp*"))
    back = AutoModelForCausalLM.from_pretrained(out)
    assert back.config.tie_word_embeddings and back.config.architectures == ["Qwen2ForCausalLM"]
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()
    for name, value in tied.state_dict().items():
        assert torch.equal(back.state_dict()[name], value.to(torch.bfloat16)), name


def test_a_missing_or_foreign_tensor_is_an_error_and_nothing_is_left(tmp_path, tied):
    partial = [(k, v) for k, v in tied.state_dict().items() if "layers.0.mlp" not in k]
    with pytest.raises(ValueError, match=r"missing \['model.layers.0.mlp"):
        save_hf_model(partial, tmp_path / "hf", tied.config)
    with pytest.raises(ValueError, match=r"unexpected \['score.weight'\]"):
        save_hf_model([*tied.state_dict().items(), ("score.weight", torch.zeros(1, 16))], tmp_path / "hf",
                      tied.config)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_users_directory_is_refused_before_any_tensor_is_read(tmp_path, tied):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")

    def never():
        raise AssertionError("the stream was read")
        yield

    with pytest.raises(NotOwnedError, match="did not write"):
        save_hf_model(never(), tmp_path / "mine", tied.config)


@pytest.mark.parametrize(("size", "expected"), [(100, 100), ("5GB", 5 * 10**9), ("2MiB", 2 * 2**20),
                                                ("1.5kb", 1500)])
def test_parse_size(size, expected):
    assert parse_size(size) == expected


@pytest.mark.parametrize("size", ["five", "10XB", 0, "-1GB"])
def test_parse_size_refuses_nonsense(size):
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size(size)
