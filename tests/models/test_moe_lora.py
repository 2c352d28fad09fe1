"""LoRA on a MoE model's fused experts (``target_parameters``) on fsdp2: training, export, reference."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from tests.engine.common import random_batch, rank_shard
from tests.models.moe_common import tiny_moe
from verl_trainer.engine import EngineConfig, EngineRegistry, GlobalBatchInfo, OptimConfig
from verl_trainer.models.moe_lora import ATTENTION_TARGETS, EXPERT_TARGETS
from verl_trainer.testing.ranks import run_distributed

LORA = {"lora_rank": 4, "lora_alpha": 8, "target_modules": list(ATTENTION_TARGETS),
        "target_parameters": list(EXPERT_TARGETS)}


def grpo_loss(model_output: dict[str, torch.Tensor], micro_batch: TensorDict,
              info: GlobalBatchInfo) -> tuple[torch.Tensor, dict[str, Any]]:
    """Clipped ratio (eps 0.2) x per-sequence advantage, token-mean over the global batch."""
    mask = micro_batch["loss_mask"].float()
    ratio = torch.exp(model_output["log_probs"] - micro_batch["old_log_probs"])
    adv = micro_batch["advantages"]
    per_token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    loss = (per_token * mask).sum() / info.batch_num_tokens * info.dp_size
    return loss, {"loss": loss.detach().item()}


def grpo_batch() -> TensorDict:
    """8 responses in 2 groups of 4; advantages = group-normalised random rewards."""
    batch = random_batch(8, seed=5)
    rewards = torch.randn(2, 4, generator=torch.Generator().manual_seed(7))
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).reshape(8, 1)
    batch["advantages"] = adv.expand_as(batch["loss_mask"]) * batch["loss_mask"]
    return batch


def _full(engine, adapters_only: bool = False) -> dict[str, torch.Tensor]:
    return {n: t.detach().cpu().clone() for n, t in engine.get_per_tensor_param(adapters_only=adapters_only)}


def expert_lora_rank(path: str, tmp: str) -> dict[str, Any]:
    engine = EngineRegistry.new("language_model", "fsdp2", EngineConfig(
        model_path=path, micro_batch_size_per_gpu=2, **LORA), OptimConfig(lr=2e-2, weight_decay=0.0))
    engine.initialize()
    shard = rank_shard(grpo_batch(), dist.get_rank(), dist.get_world_size())
    out: dict[str, Any] = {"merged0": _full(engine), "adapters0": _full(engine, True)}
    with engine.eval_mode():
        out["ref"] = engine.infer_batch(shard)["model_output"]["log_probs"]
    for _ in range(2):
        with engine.eval_mode():
            shard["old_log_probs"] = engine.infer_batch(shard)["model_output"]["log_probs"]
        with engine.train_mode():
            engine.train_batch(shard, grpo_loss)
    with engine.eval_mode():
        out["log_probs"] = engine.infer_batch(shard)["model_output"]["log_probs"]
        with engine.disable_adapters():
            out["ref_after"] = engine.infer_batch(shard)["model_output"]["log_probs"]
    out["merged"], out["adapters"] = _full(engine), _full(engine, True)
    engine.save_adapter(os.path.join(tmp, "adapter"))
    engine.save_hf(os.path.join(tmp, "hf"), tokenizer=None)
    loaded = EngineRegistry.new("language_model", "fsdp2", EngineConfig(
        model_path=path, lora_adapter_path=os.path.join(tmp, "adapter")), OptimConfig())
    loaded.initialize()
    out["merged_loaded"] = _full(loaded)
    out["shard"] = shard
    return out


def test_expert_lora_trains_adapters_only_and_exports_peft_merge(tmp_path) -> None:
    from peft import PeftModel

    from verl_trainer.models.loading import load_causal_lm

    path = tiny_moe(str(tmp_path / "model"))
    out = run_distributed(expert_lora_rank, 2, path, str(tmp_path))
    r0 = out[0]
    base = load_causal_lm(path).state_dict()
    # before training (B = 0) the merged export is the base model; after 2 steps only adapters moved
    assert sorted(r0["merged0"]) == sorted(base)
    assert all(torch.equal(r0["merged0"][n], t) for n, t in base.items())
    expert_adapters = [n for n in r0["adapters"] if ".experts." in n]
    assert len(expert_adapters) == 2 * 2 * 2  # 2 layers x (gate_up, down) x (A, B)
    moved_b = [not torch.equal(t, r0["adapters0"][n]) for n, t in r0["adapters"].items() if "lora_B" in n]
    assert moved_b and all(moved_b)
    changed = {n for n in base if not torch.equal(r0["merged"][n], base[n])}
    assert {n for n in changed if "experts" in n} == {n for n in base if "experts" in n}
    assert all(any(t in n for t in ATTENTION_TARGETS + ["experts"]) for n in changed)  # nothing else moved

    # the saved adapter = peft's; peft's merge_and_unload equals the merged stream (fp32, 1e-6)
    peft_model = PeftModel.from_pretrained(load_causal_lm(path), str(tmp_path / "adapter"))
    peft_model.eval()
    want = {n: t.clone() for n, t in peft_model.merge_and_unload().state_dict().items()}
    peft_model = PeftModel.from_pretrained(load_causal_lm(path), str(tmp_path / "adapter")).eval()
    assert sorted(want) == sorted(r0["merged"])
    for name, value in want.items():
        torch.testing.assert_close(r0["merged"][name], value, rtol=1e-6, atol=1e-6)
        assert torch.equal(r0["merged_loaded"][name], r0["merged"][name]), name

    # log-probs: the engine's = the peft model's = save_hf's merged model's (1e-5); reference = base model
    merged_model = load_causal_lm(str(tmp_path / "hf"))
    for name, value in merged_model.state_dict().items():  # save_hf writes the merged stream
        assert torch.equal(value, r0["merged"][name]), name
    for rank_out in out:
        shard = rank_out["shard"]
        mask = shard["loss_mask"].bool()
        with torch.no_grad():
            for model in (peft_model, merged_model):
                logits = model(input_ids=shard["input_ids"], attention_mask=shard["attention_mask"]).logits
                lp = torch.log_softmax(logits[:, :-1].float(), -1)
                lp = lp.gather(-1, shard["input_ids"][:, 1:, None])[..., 0]
                got = rank_out["log_probs"][:, 1:]
                torch.testing.assert_close(got[mask[:, 1:]], lp[mask[:, 1:]], rtol=0, atol=1e-5)
        torch.testing.assert_close(rank_out["ref_after"], rank_out["ref"], rtol=0, atol=1e-6)
        assert (rank_out["log_probs"] - rank_out["ref"]).abs().max() > 1e-3
