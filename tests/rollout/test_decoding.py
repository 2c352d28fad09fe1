"""The rollout's decoding loops: dropping finished rows, static KV cache, compiled decoding (CPU)."""

import math

import pytest
import torch
from torch import nn

from verl_trainer.data import schema
from verl_trainer.models import load_causal_lm, make_tiny_model
from verl_trainer.rollout import HFRollout, RolloutConfig
from verl_trainer.rollout.hf import resolve_decoding
from verl_trainer.rollout.sampling import sample_dropping_finished

EOS = 2
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def peaked_model_path(tmp_path_factory) -> str:
    """Weights large enough that greedy choices are not near-ties (robust to batch-size round-off)."""
    return make_tiny_model(tmp_path_factory.mktemp("decoding") / "m", seed=3, initializer_range=0.3,
                           max_position_embeddings=64)


def _with_eos_bias(path: str, bias: float) -> nn.Module:
    """The real model with ``bias`` added to the eos logit, so responses end at varied lengths."""
    model = load_causal_lm(path).eval()
    head = nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[EOS] = bias
    model.lm_head = head
    return model


def _prompts(tokenizer, n: int) -> list[list[int]]:
    texts = ["3+4=", "12+30=", "5*5=", "7-2=", "100/4=", "9="]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts for _ in range(n)]


def _run_both(rollout: HFRollout, prompts, config: RolloutConfig, drop_at: float):
    """(generate's responses, the dropping loop's), both cut at eos, from the same seed."""
    input_ids, mask = rollout._left_pad(prompts)
    gen_config = rollout.generation_config(config)
    with torch.no_grad():
        torch.manual_seed(11)
        ref = rollout.model.generate(input_ids=input_ids, attention_mask=mask, generation_config=gen_config)
        torch.manual_seed(11)
        ours, _ = sample_dropping_finished(rollout.model, input_ids, mask, gen_config, drop_at=drop_at)
    cut = [r[: r.index(EOS) + 1] if EOS in r else r for r in ref[:, input_ids.shape[1]:].tolist()]
    return cut, ours


def test_drop_finished_samples_as_generate(peaked_model_path, tokenizer):
    """Never dropping, the loop draws generate's random numbers: the same tokens (top-k, top-p, T)."""
    config = RolloutConfig(max_new_tokens=24, temperature=0.8, top_k=20, top_p=0.9, decoding="drop_finished")
    rollout = HFRollout(config, _with_eos_bias(peaked_model_path, 3.0), tokenizer)
    ref, ours = _run_both(rollout, _prompts(tokenizer, 4), config, drop_at=float("inf"))
    assert ours == ref
    lengths = {len(r) for r in ref}
    assert len(lengths) > 3 and max(lengths) == 24  # rows stop at many different steps


def test_drop_finished_greedy_equals_generate(peaked_model_path, tokenizer):
    """Dropping at every finish (the KV cache re-indexed often): greedy tokens equal generate's."""
    config = RolloutConfig(max_new_tokens=24, do_sample=False, decoding="drop_finished")
    rollout = HFRollout(config, _with_eos_bias(peaked_model_path, 1.5), tokenizer)
    ref, ours = _run_both(rollout, _prompts(tokenizer, 1), config, drop_at=1e-9)
    assert ours == ref
    assert len({len(r) for r in ref}) > 2


def constant_eos_model(path: str) -> nn.Module:
    """The real model with constant logits: p(eos) = 1/8 at every step, the other tokens uniform."""
    model = load_causal_lm(path).eval()
    vocab = model.lm_head.out_features
    head = nn.Linear(model.lm_head.in_features, vocab, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[EOS] = math.log((vocab - 1) / 7)  # exp(b) / (exp(b) + vocab - 1) = 1/8
    model.lm_head = head
    torch.testing.assert_close(torch.softmax(head.bias, 0)[EOS], torch.tensor(1 / 8))
    return model


def test_drop_finished_length_distribution(rollout_model_path, tokenizer):
    """Constant logits with p(eos) = 1/8: lengths are geometric capped at 12, also with rows dropped."""
    model = constant_eos_model(rollout_model_path)
    p = 1 / 8
    rollout = HFRollout(RolloutConfig(max_new_tokens=12, decoding="drop_finished"), model, tokenizer)
    prompts = _prompts(tokenizer, 200)
    input_ids, mask = rollout._left_pad(prompts)
    torch.manual_seed(0)
    out, _ = sample_dropping_finished(model, input_ids, mask, rollout.generation_config(rollout.config))
    lengths = torch.tensor([len(r) for r in out], dtype=torch.float64)
    expected = (1 - (1 - p) ** 12) / p  # E[min(Geometric(p), 12)]
    std = lengths.std() / math.sqrt(len(out))
    assert abs(lengths.mean().item() - expected) < 4 * std
    assert all((r[-1] == EOS) == (EOS in r) and r.count(EOS) <= 1 for r in out)
    assert ((lengths == 12).double().mean() - (1 - p) ** 11).abs() < 0.05


def test_static_cache_greedy_equals_dynamic(peaked_model_path, tokenizer, prompt_items):
    """HF generate with a static KV cache decodes the same greedy tokens as with the dynamic one."""
    outs = {}
    for cache in ("dynamic", "static"):
        cfg = RolloutConfig(do_sample=False, max_new_tokens=10, decoding="generate",
                            cache_implementation=cache)
        rollout = HFRollout(cfg, _with_eos_bias(peaked_model_path, 1.5), tokenizer)
        assert rollout.generation_config(cfg).cache_implementation == cache
        outs[cache] = rollout.generate(prompt_items)[schema.INPUT_IDS]
    assert torch.equal(outs["static"], outs["dynamic"])


@pytest.mark.slow
def test_compiled_static_decoding_greedy_equals_dynamic(peaked_model_path, tokenizer, prompt_items):
    """Compiled decoding (inductor on CPU, forced with transformers' switch) decodes the same tokens."""
    ref_cfg = RolloutConfig(do_sample=False, max_new_tokens=10, decoding="generate",
                            cache_implementation="dynamic")
    ref = HFRollout(ref_cfg, _with_eos_bias(peaked_model_path, 1.5), tokenizer).generate(prompt_items)
    cfg = RolloutConfig(do_sample=False, max_new_tokens=10, compile_decoding=True)
    rollout = HFRollout(cfg, _with_eos_bias(peaked_model_path, 1.5), tokenizer)
    assert resolve_decoding(cfg, CPU) == ("generate", "static", True)
    assert torch.equal(rollout.generate(prompt_items)[schema.INPUT_IDS], ref[schema.INPUT_IDS])


def test_resolve_decoding_and_config_errors():
    cuda = torch.device("cuda")
    assert resolve_decoding(RolloutConfig(), CPU) == ("drop_finished", "dynamic", False)
    assert resolve_decoding(RolloutConfig(), cuda) == ("generate", "static", True)
    assert resolve_decoding(RolloutConfig(compile_decoding=False), cuda) == ("generate", "static", False)
    static = RolloutConfig(cache_implementation="static")
    assert resolve_decoding(static, CPU) == ("generate", "static", False)
    assert resolve_decoding(RolloutConfig(decoding="generate"), CPU) == ("generate", "dynamic", False)
    with pytest.raises(ValueError, match=r"decoding='beam'.*one of \('auto', 'generate', 'drop_finished'\)"):
        RolloutConfig(decoding="beam")
    with pytest.raises(ValueError, match="cache_implementation='paged'"):
        RolloutConfig(cache_implementation="paged")
    with pytest.raises(ValueError, match="drop_finished.*use decoding='generate'"):
        RolloutConfig(decoding="drop_finished", cache_implementation="static")
    with pytest.raises(ValueError, match="compile_decoding=True needs cache_implementation='static'"):
        RolloutConfig(compile_decoding=True, cache_implementation="dynamic")


def test_drop_finished_refuses_unsupported_settings(rollout_model_path, tokenizer):
    from transformers import GenerationConfig

    model = load_causal_lm(rollout_model_path).eval()
    ids = torch.tensor([[5, 6, 7]])
    bad = GenerationConfig(max_new_tokens=4, eos_token_id=[EOS], do_sample=True, repetition_penalty=1.3)
    with pytest.raises(ValueError, match="repetition_penalty.*decoding='generate'"):
        sample_dropping_finished(model, ids, torch.ones_like(ids), bad)
    with pytest.raises(ValueError, match="drop_at=0"):
        sample_dropping_finished(model, ids, torch.ones_like(ids),
                                 GenerationConfig(max_new_tokens=4, eos_token_id=[EOS]), drop_at=0)
