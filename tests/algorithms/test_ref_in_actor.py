"""The RL reference policy is the LoRA actor with its adapters disabled (no second engine), by default."""

from __future__ import annotations

import pytest

from verl_trainer.algorithms import GRPO, PPO
from verl_trainer.algorithms.config import ActorConfig, GRPOConfig, PPOConfig, RefConfig
from verl_trainer.core_algos.losses import PPOLossConfig
from verl_trainer.engine.config import EngineConfig

KL = PPOLossConfig(use_kl_loss=True)


def _actor(lora_rank: int, kl: bool = True) -> ActorConfig:
    return ActorConfig(engine=EngineConfig(lora_rank=lora_rank), loss=KL if kl else PPOLossConfig())


@pytest.mark.parametrize(
    ("lora_rank", "in_actor", "engines"),
    [
        (8, None, ["actor"]),           # LoRA + KL: the reference lives in the actor by default
        (8, False, ["actor", "ref"]),   # asked for a separate reference engine
        (0, None, ["actor", "ref"]),    # full fine-tuning needs the second model
    ],
)
def test_grpo_builds_a_ref_engine_only_when_the_actor_cannot_be_the_reference(lora_rank, in_actor, engines):
    config = GRPOConfig(model_path="m", actor=_actor(lora_rank), ref=RefConfig(in_actor=in_actor))
    assert config.ref_in_actor == (lora_rank > 0 and in_actor is not False)
    assert list(GRPO(config).configure_engines()) == engines


def test_ppo_kl_in_reward_uses_the_actor_as_reference():
    config = PPOConfig(model_path="m", actor=_actor(8, kl=False), use_kl_in_reward=True)
    assert sorted(PPO(config).configure_engines()) == ["actor", "critic"]


def test_ref_in_actor_without_lora_is_an_error():
    with pytest.raises(ValueError, match=r"ref.in_actor=true .* set actor.engine.lora_rank > 0"):
        GRPOConfig(model_path="m", actor=_actor(0), ref=RefConfig(in_actor=True))


def test_grpo_lora_yaml_loads_with_the_reference_in_the_actor():
    from pathlib import Path

    from verl_trainer.recipe_config import GRPORecipeConfig, load_config

    path = Path(__file__).resolve().parents[2] / "configs" / "grpo_lora.yaml"
    cfg = load_config(GRPORecipeConfig, path, ["algorithm.actor.engine.target_modules=[q_proj,v_proj]"])
    engine = cfg.algorithm.actor.engine
    assert (engine.lora_rank, engine.lora_alpha, engine.target_modules) == (16, 32, ["q_proj", "v_proj"])
    assert cfg.algorithm.actor.loss.use_kl_loss and cfg.algorithm.ref_in_actor
    assert load_config(GRPORecipeConfig, path).algorithm.actor.engine.target_modules == "all-linear"
