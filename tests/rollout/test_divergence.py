"""Diverged (non-finite) weights are reported as divergence with the step, not as a sampler error.

Before: NaN weights made ``torch.multinomial`` fail ("probability tensor contains either inf, nan or
element < 0"), and greedy decoding silently returned token 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from verl_trainer.models import load_causal_lm
from verl_trainer.rollout import HFRollout, RolloutConfig
from verl_trainer.rollout.divergence import DivergenceError

ROOT = Path(__file__).resolve().parents[2]
NAMED = r"training diverged: the policy's logits are non-finite, and 1 of its \d+ parameter tensors are " \
        r"non-finite \(model.layers.0.mlp.up_proj.weight\)"


@pytest.mark.parametrize("decoding, do_sample", [("generate", True), ("drop_finished", True),
                                                 ("drop_finished", False)])
def test_nan_weights_are_named_as_divergence(rollout_model_path, tokenizer, prompt_items, decoding,
                                             do_sample):
    model = load_causal_lm(rollout_model_path).eval()
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    config = RolloutConfig(max_new_tokens=4, decoding=decoding, do_sample=do_sample)
    rollout = HFRollout(config, model, tokenizer)
    with pytest.raises(DivergenceError, match=NAMED):
        rollout.generate(prompt_items)


def _grpo_poisoned_after_step_1(model: str, data: str) -> str:
    from verl_trainer import Trainer
    from verl_trainer.algorithms import GRPO, PromptDataModule
    from verl_trainer.callbacks import Callback
    from verl_trainer.models.loading import load_tokenizer
    from verl_trainer.recipe_config import GRPORecipeConfig, load_config

    class Poison(Callback):  # what a diverging update does to the weights
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            with torch.no_grad():
                for name, param in module.engines["actor"].module.named_parameters():
                    if "layers.0.mlp.up_proj" in name:
                        local = param.to_local() if hasattr(param, "to_local") else param  # fsdp2: a DTensor
                        local.fill_(float("nan"))

    cfg = load_config(GRPORecipeConfig, ROOT / "configs" / "grpo.yaml", [
        f"algorithm.model_path={model}", f"data.train_files={data}/train.jsonl", "data.val_files=null",
        "data.train_batch_size=2", "algorithm.rollout.n=2", "algorithm.rollout.max_new_tokens=3",
        "algorithm.actor.ppo_mini_batch_size=2", "algorithm.actor.engine.micro_batch_size_per_gpu=4",
    ])
    trainer = Trainer(devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, callbacks=[Poison()])
    try:
        trainer.fit(GRPO(cfg.algorithm), datamodule=PromptDataModule(cfg.data, load_tokenizer(model)))
    except DivergenceError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow  # ~36 s: a 1-rank GRPO fit
def test_grpo_reports_the_step_whose_rollout_saw_diverged_weights(tmp_path):
    from verl_trainer.data.tasks import ArithmeticTaskConfig, write_arithmetic_task
    from verl_trainer.models.tiny import make_tiny_model
    from verl_trainer.testing import run_distributed

    make_tiny_model(tmp_path / "model", hidden_size=32, num_attention_heads=4, num_key_value_heads=2, seed=1)
    write_arithmetic_task(tmp_path / "data", ArithmeticTaskConfig(num_train=8, num_val=2))
    (message,) = run_distributed(_grpo_poisoned_after_step_1, 1, str(tmp_path / "model"),
                                 str(tmp_path / "data"), timeout=300)
    assert message.startswith("step 2 (its rollout): training diverged: the policy's logits are non-finite")
    assert "layers.0.mlp.up_proj.weight" in message and "Lower the learning rate" in message
