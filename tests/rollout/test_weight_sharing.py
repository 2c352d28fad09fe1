"""The HF rollout aliasing the actor's parameters (no copy per step) where the engine holds them whole."""

import pytest
import torch
import torch.distributed as dist

from verl_trainer.data import schema
from verl_trainer.engine import OptimConfig
from verl_trainer.models import load_causal_lm
from verl_trainer.rollout import HFRollout, RolloutConfig
from verl_trainer.testing.ranks import run_distributed


def test_share_weights_aliases_and_reports(rollout_model_path, other_model_path, prompt_items):
    cfg = RolloutConfig(n=2, max_new_tokens=6, seed=3)
    rollout = HFRollout(cfg, rollout_model_path)
    trained = load_causal_lm(other_model_path)
    params = {n: p.detach() for n, p in trained.named_parameters()}
    assert rollout.share_weights(params) == len(params)
    for name, p in rollout.model.named_parameters():
        assert p.data_ptr() == params[name].data_ptr() and not p.requires_grad
    target = HFRollout(cfg, other_model_path).generate(prompt_items)
    assert torch.equal(rollout.generate(prompt_items)[schema.INPUT_IDS], target[schema.INPUT_IDS])
    with torch.no_grad():  # an in-place update of the source (what the optimizer does) reaches the rollout
        params["lm_head.weight"].mul_(2.0)
    assert torch.equal(rollout.model.lm_head.weight, params["lm_head.weight"])
    assert rollout.share_weights(params) == len(params)  # same storage: nothing to do
    assert rollout.update_weights(trained.state_dict().items()) == len(trained.state_dict())  # no self-copy
    # another dtype is copied, not aliased
    half = {n: t.to(torch.float64) for n, t in params.items()}
    rollout.share_weights(half)
    assert rollout.model.lm_head.weight.dtype == torch.float32
    assert rollout.model.lm_head.weight.data_ptr() == params["lm_head.weight"].data_ptr()
    with pytest.raises(ValueError, match="not sent: lm_head.weight"):
        rollout.share_weights({n: t for n, t in params.items() if n != "lm_head.weight"})
    with pytest.raises(ValueError, match="does not have: extra"):
        rollout.share_weights({**params, "extra": torch.zeros(1)})


def test_share_weights_tied(rollout_model_path, tokenizer):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(rollout_model_path)
    config.tie_word_embeddings = True
    tied = AutoModelForCausalLM.from_config(config)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    rollout = HFRollout(RolloutConfig(), tied, tokenizer)
    params = {n: p.detach().clone() for n, p in tied.named_parameters()}
    assert "lm_head.weight" not in params  # one parameter under two names
    rollout.share_weights(params)
    emb = params["model.embed_tokens.weight"]
    assert rollout.model.lm_head.weight.data_ptr() == emb.data_ptr()
    assert rollout.model.model.embed_tokens.weight.data_ptr() == emb.data_ptr()


def _share_on_rank(model_path: str) -> dict:
    from verl_trainer.engine import EngineConfig, EngineRegistry

    from ..engine.common import nll_loss, random_batch

    engine = EngineRegistry.new("language_model", "fsdp2", EngineConfig(model_path=model_path),
                                OptimConfig(lr=1e-2))
    engine.initialize()
    shareable = engine.get_shareable_params()
    if dist.get_world_size() > 1:
        return {"shareable": shareable is not None}
    rollout = HFRollout(RolloutConfig(do_sample=False, max_new_tokens=6), model_path)
    rollout.share_weights(shareable)
    with engine.train_mode():
        engine.train_batch(random_batch(), nll_loss)
    full = {n: t.clone() for n, t in engine.get_per_tensor_param()}
    copied = HFRollout(RolloutConfig(do_sample=False, max_new_tokens=6), model_path)
    copied.update_weights(full.items())
    prompts = [{"input_ids": [5, 6, 7], "index": 0}, {"input_ids": [9, 8], "index": 1}]
    return {
        "shareable": True,
        "aliased": all(p.data_ptr() == shareable[n].data_ptr() for n, p in rollout.model.named_parameters()),
        "equal": all(torch.equal(rollout.model.get_parameter(n), t) for n, t in full.items()),
        "changed": not torch.equal(full["lm_head.weight"], load_causal_lm(model_path).lm_head.weight),
        "same_tokens": torch.equal(rollout.generate(prompts)[schema.INPUT_IDS],
                                   copied.generate(prompts)[schema.INPUT_IDS]),
    }


def test_fsdp2_one_rank_rollout_sees_updates_without_copy(rollout_model_path):
    (result,) = run_distributed(_share_on_rank, 1, rollout_model_path)
    assert result == {"shareable": True, "aliased": True, "equal": True, "changed": True, "same_tokens": True}


@pytest.mark.slow
def test_fsdp2_sharded_parameters_are_not_shareable(rollout_model_path):
    assert run_distributed(_share_on_rank, 2, rollout_model_path) == [{"shareable": False}] * 2
