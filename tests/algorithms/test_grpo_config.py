"""GRPO/Dr.GRPO configs and the group advantages of one rank's batch."""

import dataclasses
from pathlib import Path

import pytest
import torch

from verl_trainer.algorithms import GRPO, PPO, DrGRPO, GRPOConfig, PPOConfig
from verl_trainer.configs import GRPORecipeConfig, load_config
from verl_trainer.data import schema
from verl_trainer.data.packing import make_batch

ROOT = Path(__file__).resolve().parents[2]


def test_dr_grpo_config_without_loss_scale_factor_is_an_error():
    with pytest.raises(ValueError, match="loss_scale_factor"):
        load_config(GRPORecipeConfig, ROOT / "configs" / "dr_grpo.yaml",
                    ["algorithm.actor.loss.loss_scale_factor=null"])


def test_dr_grpo_needs_its_config():
    with pytest.raises(ValueError, match="norm_adv_by_std_in_grpo=false.*seq-mean-token-sum-norm"):
        DrGRPO(GRPOConfig(model_path="unused"))
    cfg = load_config(GRPORecipeConfig, ROOT / "configs" / "dr_grpo.yaml").algorithm
    assert not cfg.norm_adv_by_std_in_grpo
    assert cfg.actor.loss.loss_scale_factor == cfg.rollout.max_new_tokens
    DrGRPO(cfg)  # builds (engines come later, in fit)


def test_config_cross_checks():
    with pytest.raises(ValueError, match="rollout.n"):
        GRPOConfig(rollout=dataclasses.replace(GRPOConfig().rollout, n=1))
    with pytest.raises(ValueError, match="PPO"):
        GRPOConfig(adv_estimator="gae")
    with pytest.raises(TypeError):
        PPO(GRPOConfig())
    with pytest.raises(TypeError):
        GRPO(PPOConfig())


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_advantages_per_group(norm):
    module = GRPO(GRPOConfig(norm_adv_by_std_in_grpo=norm))
    batch = make_batch([[4, 5]] * 4, [[6], [6, 7], [6], [6, 7, 8]], uids=[0, 0, 1, 1])
    scores = torch.tensor([1.0, 0.0, 0.5, 0.5])
    from verl_trainer.rewards import token_level_scores

    batch[schema.TOKEN_LEVEL_REWARDS] = token_level_scores(scores, batch[schema.RESPONSE_MASK])
    metrics = {}
    module.compute_advantages(batch, scores, metrics)
    adv = batch[schema.ADVANTAGES]
    mask = batch[schema.RESPONSE_MASK].bool()
    per_sample = [adv[i][mask[i]].unique().tolist() for i in range(4)]
    scale = 1 / (2**0.5 / 2 + 1e-6) if norm else 1.0  # group std of {1, 0} is sqrt(1/2)
    assert per_sample[0] == pytest.approx([0.5 * scale]) and per_sample[1] == pytest.approx([-0.5 * scale])
    assert per_sample[2] == [0.0] and per_sample[3] == [0.0]  # equal rewards: no signal
    assert (adv[~mask] == 0).all()
    assert "critic/advantages/mean" in metrics
