import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM, Qwen2ForCausalLM

from verl_trainer.models import (
    build_tokenizer,
    load_causal_lm,
    load_tokenizer,
    load_value_model,
    make_tiny_model,
)
from verl_trainer.models.tiny import CHARS, MOE_ARCHITECTURES

TEXT = "12+7=19\n(3*4)/2 - x^2 = 8; Hello, World! \"quoted\" 50% done."


@pytest.mark.parametrize("arch,cls", [("qwen2", Qwen2ForCausalLM), ("llama", LlamaForCausalLM)])
def test_make_and_load_causal_lm(tiny_model_paths, arch, cls):
    path = Path(tiny_model_paths[arch])
    assert (path / "config.json").exists() and (path / "model.safetensors").exists()
    assert (path / "tokenizer.json").exists()
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == arch and config["num_hidden_layers"] == 2
    assert config["num_key_value_heads"] == 2 and config["num_attention_heads"] == 4
    model = load_causal_lm(path)
    assert isinstance(model, cls)
    assert next(model.parameters()).dtype == torch.float32
    tok = load_tokenizer(path)
    assert model.config.vocab_size == len(tok)
    assert model.config.eos_token_id == tok.eos_token_id
    ids = torch.tensor([tok(TEXT)["input_ids"]])
    assert model(ids).logits.shape == (1, ids.shape[1], len(tok))
    varlen = load_causal_lm(path, attn_implementation="verl_varlen")
    assert varlen.config._attn_implementation == "verl_varlen"
    for (name, p), (_, q) in zip(model.named_parameters(), varlen.named_parameters()):
        assert torch.equal(p, q), name


def test_seed_controls_weights(tmp_path):
    a = load_causal_lm(make_tiny_model(tmp_path / "a", seed=1, num_hidden_layers=1))
    b = load_causal_lm(make_tiny_model(tmp_path / "b", seed=1, num_hidden_layers=1))
    c = load_causal_lm(make_tiny_model(tmp_path / "c", seed=2, num_hidden_layers=1))
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    state = torch.random.get_rng_state()
    make_tiny_model(tmp_path / "d", seed=3, num_hidden_layers=1)
    assert torch.equal(state, torch.random.get_rng_state())


def test_unknown_arch(tmp_path):
    with pytest.raises(ValueError, match="qwen2"):
        make_tiny_model(tmp_path, arch="gpt5")


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_value_model(tiny_model_paths, arch):
    value = load_value_model(tiny_model_paths[arch])
    assert value.config.num_labels == 1 and value.dropout.p == 0.0
    again = load_value_model(tiny_model_paths[arch])
    assert torch.equal(value.score.weight, again.score.weight)  # same head on every rank
    causal = load_causal_lm(tiny_model_paths[arch])
    torch.testing.assert_close(value.model.embed_tokens.weight, causal.model.embed_tokens.weight)
    out = value(torch.tensor([[5, 6, 7, 8]])).logits
    assert out.shape == (1, 4, 1)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tokenizer_round_trip_after_from_pretrained(tiny_model_paths, arch):
    # qwen2 checkpoints go through Qwen2Tokenizer (AutoTokenizer forces it); llama through TokenizersBackend.
    for tok in (build_tokenizer(), load_tokenizer(tiny_model_paths[arch])):
        ids = tok(TEXT)["input_ids"]
        assert len(ids) == len(TEXT)  # one token per character
        assert tok.decode(ids) == TEXT
        assert tok.decode(tok(CHARS)["input_ids"]) == CHARS
        assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
        assert tok("<bos>1+1<eos>")["input_ids"] == [1, *tok("1+1")["input_ids"], 2]
        assert tok.decode(tok("<bos>ab<eos>")["input_ids"], skip_special_tokens=True) == "ab"
        padded = tok(["12", "3"], padding=True, return_tensors="pt")
        assert padded["input_ids"][1, 1] == 0 and padded["attention_mask"].tolist() == [[1, 1], [1, 0]]


def test_chat_template():
    tok = build_tokenizer()
    messages = [{"role": "user", "content": "1+1"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "user: 1+1\nassistant: "


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_tiny_moe_models(tmp_path, arch):
    """Each MoE architecture builds tiny (4 experts, top-2), loads through from_pretrained and generates."""
    path = make_tiny_model(tmp_path, arch=arch, hidden_size=32, num_key_value_heads=4, num_hidden_layers=1)
    model = load_causal_lm(path)
    config = model.config
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    assert (experts or config.n_routed_experts) == 4 and config.num_experts_per_tok == 2
    ids = torch.tensor([[5, 6, 7, 8]])
    assert model(ids).logits.shape == (1, 4, config.vocab_size)
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 7)
