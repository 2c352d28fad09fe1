"""GRPO/Dr.GRPO configs and the group advantages of one rank's batch."""

import dataclasses
from pathlib import Path

import pytest
import torch

from verl_trainer.algorithms import GRPO, PPO, DrGRPO, GRPOConfig, PPOConfig
from verl_trainer.data import schema
from verl_trainer.data.packing import make_batch
from verl_trainer.recipe_config import GRPORecipeConfig, load_config

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


# ------------------------------------------------------------------ estimators by name (issue 30)
def test_every_estimator_grpo_can_feed_is_usable_by_name():
    """The registry says what an estimator reads; GRPO takes every one it can feed, refuses the rest."""
    from verl_trainer.core_algos.advantages import ADV_ESTIMATOR_REGISTRY, estimator_inputs, register_adv_est

    assert estimator_inputs("grpo") == {"index"} and estimator_inputs("gae") == {"values"}
    assert estimator_inputs("remax") == {"reward_baselines"}
    assert estimator_inputs("reinforce_plus_plus") == set()

    @register_adv_est("test_mine")
    def mine(token_level_rewards, response_mask, index, **kwargs):
        return token_level_rewards, token_level_rewards

    try:
        for name in ADV_ESTIMATOR_REGISTRY:
            if name != "gae":  # pass_at_k also needs its k
                extra = {"pass_k": 2} if name == "pass_at_k" else {}
                assert GRPOConfig(adv_estimator=name, **extra).adv_estimator == name
        with pytest.raises(ValueError, match=r"'gae' reads a critic's values.*PPO.*'remax'.*'test_mine'"):
            GRPOConfig(adv_estimator="gae")
        with pytest.raises(ValueError, match=r"adv_estimator='nope'.*registered: .*'reinforce_plus_plus'"):
            GRPOConfig(adv_estimator="nope")
    finally:
        del ADV_ESTIMATOR_REGISTRY["test_mine"]


def _rpp_batch():
    batch = make_batch([[4, 5]] * 4, [[6], [6, 7], [6], [6, 7, 8]], uids=[0, 0, 1, 1])
    from verl_trainer.rewards import token_level_scores

    batch[schema.TOKEN_LEVEL_REWARDS] = token_level_scores(torch.tensor([1.0, 0.0, 0.25, 2.0]),
                                                           batch[schema.RESPONSE_MASK])
    return batch


def _rpp_rank() -> torch.Tensor:
    import torch.distributed as dist

    module = GRPO(GRPOConfig(adv_estimator="reinforce_plus_plus", gamma=0.9))  # no Trainer: the default group
    rank = dist.get_rank()
    batch = _rpp_batch()[2 * rank: 2 * rank + 2]
    module.compute_advantages(batch, torch.zeros(2), {})
    return batch[schema.ADVANTAGES]


def test_reinforce_plus_plus_through_grpo_does_not_depend_on_dp():
    """REINFORCE++ from the GRPO recipe: whitened over the whole DP batch, the same on 1 and 2 ranks."""
    from verl_trainer.core_algos import get_adv_estimator_fn
    from verl_trainer.testing.ranks import run_distributed

    batch = _rpp_batch()
    module = GRPO(GRPOConfig(adv_estimator="reinforce_plus_plus", gamma=0.9))
    module.compute_advantages(batch, torch.zeros(4), {})
    want, _ = get_adv_estimator_fn("reinforce_plus_plus")(
        token_level_rewards=batch[schema.TOKEN_LEVEL_REWARDS], response_mask=batch[schema.RESPONSE_MASK],
        config={"gamma": 0.9})
    torch.testing.assert_close(batch[schema.ADVANTAGES], want)
    halves = run_distributed(_rpp_rank, 2)
    torch.testing.assert_close(torch.cat(halves), want)
