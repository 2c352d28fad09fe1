import math
import sys

import pytest
import torch
from torch import nn

from verl_trainer.data import schema
from verl_trainer.data.prompts import collate_prompts
from verl_trainer.data.schema import tensor_only
from verl_trainer.models import load_causal_lm
from verl_trainer.rollout import (
    RESPONSE_TEXT,
    HFRollout,
    RolloutConfig,
    build_rollout,
    truncate_at_eos,
    vllm_available,
)

EOS = 2


def _check_schema(batch, prompts, n, tokenizer):
    b = len(prompts) * n
    assert batch.batch_size == torch.Size([b])
    ids, lens = batch[schema.INPUT_IDS], batch[schema.SEQ_LEN]
    assert torch.equal(batch[schema.ATTENTION_MASK].sum(-1), lens)
    assert torch.equal(lens, batch[schema.PROMPT_LEN] + batch[schema.RESPONSE_LEN])
    pos = torch.arange(ids.shape[1])
    in_resp = (pos >= batch[schema.PROMPT_LEN][:, None]) & (pos < lens[:, None])
    assert torch.equal(batch[schema.RESPONSE_MASK].bool(), in_resp)
    assert torch.equal(batch[schema.LOSS_MASK].bool(), in_resp)
    assert torch.equal(batch[schema.POSITION_IDS], pos * batch[schema.ATTENTION_MASK])
    for i in range(b):
        p = prompts[i // n]
        assert ids[i, : len(p)].tolist() == p
        assert int(batch[schema.PROMPT_LEN][i]) == len(p)
        resp = ids[i, len(p): int(lens[i])].tolist()
        assert 1 <= len(resp)
        assert EOS not in resp[:-1]  # nothing after the first eos
        assert (ids[i, int(lens[i]):] == 0).all()
        assert batch[RESPONSE_TEXT][i] == tokenizer.decode(resp, skip_special_tokens=True)


def test_generate_schema_groups_and_reward_data(rollout_model_path, tokenizer, prompt_items):
    cfg = RolloutConfig(n=3, max_new_tokens=6, seed=1)
    batch = HFRollout(cfg, rollout_model_path).generate(prompt_items)
    prompts = [it["input_ids"] for it in prompt_items]
    _check_schema(batch, prompts, 3, tokenizer)
    assert batch[schema.UID].tolist() == [10, 10, 10, 11, 11, 11, 12, 12, 12]
    assert list(batch["ground_truth"]) == ["7"] * 3 + ["42"] * 3 + ["25"] * 3
    assert list(batch["data_source"]) == ["arithmetic"] * 9
    assert [e["i"] for e in batch["extra_info"]] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert (batch[schema.RESPONSE_LEN] <= 6).all()
    assert not batch[schema.IS_PADDING].any()
    # The n samples of a prompt are different draws.
    assert len({tuple(r.tolist()) for r in batch[schema.INPUT_IDS][:3]}) > 1
    # A collated TensorDict prompt batch gives the same result as the raw items.
    again = HFRollout(cfg, rollout_model_path).generate(collate_prompts(prompt_items))
    assert torch.equal(again[schema.INPUT_IDS], batch[schema.INPUT_IDS])
    stripped = tensor_only(batch)
    assert RESPONSE_TEXT not in stripped.keys() and "ground_truth" not in stripped.keys()
    assert schema.INPUT_IDS in stripped.keys()


def test_reproducible_with_seed(rollout_model_path, prompt_items):
    cfg = RolloutConfig(n=2, max_new_tokens=6, seed=7)
    r1, r2 = HFRollout(cfg, rollout_model_path), HFRollout(cfg, rollout_model_path)
    a1, a2 = r1.generate(prompt_items), r2.generate(prompt_items)
    assert torch.equal(a1[schema.INPUT_IDS], a2[schema.INPUT_IDS])
    b1 = r1.generate(prompt_items)  # the next call draws new samples
    assert not torch.equal(a1[schema.INPUT_IDS], b1[schema.INPUT_IDS])
    assert torch.equal(b1[schema.INPUT_IDS], r2.generate(prompt_items)[schema.INPUT_IDS])
    other = HFRollout(RolloutConfig(n=2, max_new_tokens=6, seed=8), rollout_model_path).generate(prompt_items)
    assert not torch.equal(a1[schema.INPUT_IDS], other[schema.INPUT_IDS])
    # the global RNG is untouched
    torch.manual_seed(3)
    expected = torch.rand(2)
    torch.manual_seed(3)
    r1.generate(prompt_items)
    assert torch.equal(torch.rand(2), expected)


def test_batched_equals_one_by_one_greedy(rollout_model_path, prompt_items):
    whole = HFRollout(RolloutConfig(do_sample=False, max_new_tokens=8), rollout_model_path)
    single = HFRollout(RolloutConfig(do_sample=False, max_new_tokens=8, generation_batch_size=1),
                       rollout_model_path)
    a, b = whole.generate(prompt_items), single.generate(prompt_items)
    assert torch.equal(a[schema.SEQ_LEN], b[schema.SEQ_LEN])
    assert torch.equal(a[schema.INPUT_IDS], b[schema.INPUT_IDS])
    # the per-call override gives the same greedy decode
    sampled = HFRollout(RolloutConfig(n=4, max_new_tokens=8), rollout_model_path)
    c = sampled.generate(prompt_items, n=1, do_sample=False)
    assert torch.equal(c[schema.INPUT_IDS], a[schema.INPUT_IDS])


def _eos_model(path, eos_bias: float):
    """A crafted model whose logits are a constant bias: eos gets ``eos_bias``, every other token 0."""
    model = load_causal_lm(path)
    vocab, hidden = model.lm_head.out_features, model.lm_head.in_features
    head = nn.Linear(hidden, vocab, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[EOS] = eos_bias
    model.lm_head = head
    return model


def test_stops_at_eos_and_keeps_it(rollout_model_path, tokenizer, prompt_items):
    greedy = HFRollout(RolloutConfig(do_sample=False, max_new_tokens=5), _eos_model(rollout_model_path, 10.0),
                       tokenizer)
    batch = greedy.generate(prompt_items)
    assert batch[schema.RESPONSE_LEN].tolist() == [1, 1, 1]
    last = batch[schema.INPUT_IDS].gather(1, (batch[schema.SEQ_LEN] - 1)[:, None]).squeeze(1)
    assert last.tolist() == [EOS] * 3
    assert list(batch[RESPONSE_TEXT]) == ["", "", ""]
    # p(eos) ~ 1/2 per step: some responses stop early (eos last), others run to max_new_tokens (no eos).
    half = math.log(len(tokenizer) - 1.0)
    sampled = HFRollout(RolloutConfig(n=16, max_new_tokens=4, seed=0), _eos_model(rollout_model_path, half),
                        tokenizer)
    batch = sampled.generate(prompt_items)
    _check_schema(batch, [it["input_ids"] for it in prompt_items], 16, tokenizer)
    lens = batch[schema.RESPONSE_LEN]
    last = batch[schema.INPUT_IDS].gather(1, (batch[schema.SEQ_LEN] - 1)[:, None]).squeeze(1)
    stopped = last == EOS
    assert stopped.any() and (~stopped).any()
    assert (lens[~stopped] == 4).all()
    assert (lens[stopped & (lens < 4)] >= 1).all() and (lens < 4).any()


def test_update_weights_matches_model(rollout_model_path, other_model_path, prompt_items):
    cfg = RolloutConfig(n=2, max_new_tokens=6, seed=3)
    target = HFRollout(cfg, other_model_path).generate(prompt_items)
    before = HFRollout(cfg, rollout_model_path).generate(prompt_items)
    assert not torch.equal(before[schema.INPUT_IDS], target[schema.INPUT_IDS])
    rollout = HFRollout(cfg, rollout_model_path)
    trained = load_causal_lm(other_model_path)
    count = rollout.update_weights((name, t.clone()) for name, t in trained.state_dict().items())
    assert count == len(trained.state_dict())
    for name, t in trained.state_dict().items():
        assert torch.equal(rollout.model.state_dict()[name], t)
    assert torch.equal(rollout.generate(prompt_items)[schema.INPUT_IDS], target[schema.INPUT_IDS])
    assert not any(p.requires_grad for p in rollout.model.parameters())
    assert not rollout.model.training


def test_update_weights_reports_mismatches(rollout_model_path):
    rollout = HFRollout(RolloutConfig(), rollout_model_path)
    state = load_causal_lm(rollout_model_path).state_dict()
    consumed = []

    def stream(items):
        for item in items:
            consumed.append(item[0])
            yield item

    items = [("module." + k, v) for k, v in state.items()]
    with pytest.raises(ValueError, match="does not have: module.model.embed_tokens.weight") as err:
        rollout.update_weights(stream(items))
    assert "were not sent" in str(err.value) and "module." in str(err.value)
    assert len(consumed) == len(items)  # drained even though the first name was wrong
    bad = dict(state)
    bad["lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"shape mismatches: lm_head.weight \(3, 3\)"):
        rollout.update_weights(bad.items())
    partial = list(state.items())[:-1]
    with pytest.raises(ValueError, match="not sent"):
        rollout.update_weights(partial)


def test_truncate_at_eos():
    assert truncate_at_eos([5, 6, 2, 0, 0], [2]) == [5, 6, 2]
    assert truncate_at_eos([2, 5], [2]) == [2]
    assert truncate_at_eos([5, 6, 7], [2]) == [5, 6, 7]
    assert truncate_at_eos([5, 9, 2], [2, 9]) == [5, 9]


def test_config_validation():
    with pytest.raises(ValueError, match="n=0"):
        RolloutConfig(n=0)
    with pytest.raises(ValueError, match="temperature"):
        RolloutConfig(temperature=0.0)
    RolloutConfig(temperature=0.0, do_sample=False)
    with pytest.raises(ValueError, match="top_p"):
        RolloutConfig(top_p=0.0)
    with pytest.raises(ValueError, match="name"):
        RolloutConfig(name="sglang")


def test_build_rollout_and_no_vllm_import(rollout_model_path):
    assert isinstance(build_rollout(RolloutConfig(name="auto"), rollout_model_path), HFRollout) \
        or vllm_available()
    # The vllm backend is registered, but the vllm package is imported only when an engine is built.
    if not vllm_available():
        assert "vllm" not in sys.modules
        with pytest.raises(ImportError, match="vllm"):
            build_rollout(RolloutConfig(name="vllm"), rollout_model_path)
