"""PPO's advantage estimator by name (issue 30): every registered one that reads the critic's values."""

import pytest
import torch

from verl_trainer.algorithms.config import PPOConfig
from verl_trainer.algorithms.stages.signal import estimator_advantages
from verl_trainer.core_algos.advantages import ADV_ESTIMATOR_REGISTRY, register_adv_est, resolve_estimator
from verl_trainer.rollout.config import RolloutConfig


@pytest.fixture
def critic_estimator():
    """A user's estimator that reads the critic's values and the group ids (registered for the test)."""
    seen = {}

    @register_adv_est("test_critic_baseline")
    def critic_baseline(token_level_rewards, response_mask, values, index, gamma, **kwargs):
        seen.update(gamma=gamma, index=index, kwargs=sorted(kwargs))
        returns = token_level_rewards.flip(-1).cumsum(-1).flip(-1) * response_mask
        return (returns - values) * response_mask, returns

    try:
        yield seen
    finally:
        del ADV_ESTIMATOR_REGISTRY["test_critic_baseline"]


def test_ppo_takes_every_estimator_that_reads_values(critic_estimator):
    assert PPOConfig().adv_estimator == "gae"
    two = RolloutConfig(n=2)
    assert PPOConfig(adv_estimator="test_critic_baseline", rollout=two).rollout.n == 2
    with pytest.raises(ValueError, match=r"'grpo' reads no critic values.*GRPO.*'gae', 'test_critic_base"):
        PPOConfig(adv_estimator="grpo")
    with pytest.raises(ValueError, match=r"'remax' reads no critic values"):
        PPOConfig(adv_estimator="remax")
    with pytest.raises(ValueError, match=r"adv_estimator='nope'.*registered: .*'gae'"):
        PPOConfig(adv_estimator="nope")
    with pytest.raises(ValueError, match=r"reads group ids and rollout.n=1.*rollout.n >= 2"):
        PPOConfig(adv_estimator="test_critic_baseline", rollout=RolloutConfig(n=1))


def test_an_estimator_gets_what_its_signature_takes(critic_estimator):
    """``estimator_advantages`` passes the inputs and options by name; a non-whitening one is used as is."""
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    values = torch.full((2, 4), 0.5) * mask
    estimator = resolve_estimator("test_critic_baseline")
    assert estimator.inputs == {"values", "index"} and estimator.whitens is None
    assert estimator.keywords is None  # **kwargs: takes any option
    adv, returns = estimator_advantages(estimator, rewards, mask, values=values, index=torch.tensor([7, 7]),
                                        gamma=0.9, lam=0.95, config=None)
    assert critic_estimator["gamma"] == 0.9 and critic_estimator["index"].tolist() == [7, 7]
    assert critic_estimator["kwargs"] == ["config", "lam"]
    torch.testing.assert_close(returns, torch.tensor([[0.0, 1.0, 1.0, 0.0], [2.0, 2.0, 0.0, 0.0]]))
    torch.testing.assert_close(adv, (returns - values) * mask)
    # gae takes no index (its signature names its keywords): not passed, no TypeError
    gae = resolve_estimator("gae")
    assert gae.whitens == "advantages" and "index" not in gae.keywords
    estimator_advantages(gae, rewards, mask, values=values, index=torch.tensor([7, 7]), gamma=1.0, lam=1.0)


def test_whitening_is_declared_at_registration():
    assert resolve_estimator("reinforce_plus_plus").whitens == "returns"
    assert resolve_estimator("grpo").whitens is None
    with pytest.raises(ValueError, match="whitens_returns or whitens_advantages, not both"):
        register_adv_est("test_both", whitens_returns=True, whitens_advantages=True)
