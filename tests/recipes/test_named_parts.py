"""Losses, estimators, callbacks and rewards named from YAML as "module:name" / "file.py:name" (issue 30)."""

import textwrap

import pytest
import torch

from verl_trainer.core_algos import get_policy_loss_fn
from verl_trainer.core_algos.advantages import resolve_estimator
from verl_trainer.core_algos.losses import PPOLossConfig
from verl_trainer.recipe_config import GRPORecipeConfig, load_config
from verl_trainer.rewards import get_reward_fn
from verl_trainer.utils.registry import load_object

USER_FILE = '''
import torch

from verl_trainer.callbacks import Callback
from verl_trainer.core_algos import agg_loss, global_batch_kwargs, register_adv_est

CALLS = []


def plain_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
               rollout_is_weights=None, global_batch_info=None):
    loss_mat = -advantages * torch.exp(log_prob - old_log_prob.detach())
    return agg_loss(loss_mat, response_mask, loss_agg_mode, **global_batch_kwargs(global_batch_info)), {}


@register_adv_est("test_named_whitening", whitens_returns=True)
def whitening(token_level_rewards, response_mask, config=None):
    returns = token_level_rewards.flip(-1).cumsum(-1).flip(-1) * response_mask
    return returns, returns


def group_mean(token_level_rewards, response_mask, index):
    return token_level_rewards, token_level_rewards


def answer_length(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str))


class CountSteps(Callback):
    def __init__(self, every=1):
        self.every = every
        CALLS.append(every)

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_parts.py"
    path.write_text(textwrap.dedent(USER_FILE))
    yield str(path)
    from verl_trainer.core_algos.advantages import ADV_ESTIMATOR_REGISTRY

    ADV_ESTIMATOR_REGISTRY.pop("test_named_whitening", None)


def test_every_part_is_nameable_from_yaml(user_file, tmp_path):
    yaml = tmp_path / "run.yaml"
    yaml.write_text(textwrap.dedent(f"""
        trainer:
          callbacks:
            - LearningRateMonitor
            - name: {user_file}:CountSteps
              init_args: {{every: 3}}
        algorithm:
          adv_estimator: {user_file}:group_mean
          actor:
            loss: {{policy_loss: "{user_file}:plain_loss"}}
          reward:
            name: {user_file}:answer_length
    """))
    cfg = load_config(GRPORecipeConfig, yaml)
    calls = load_object(f"{user_file}:CALLS", "test")
    assert calls == []  # checked, nothing built yet
    assert get_policy_loss_fn(cfg.algorithm.actor.loss.policy_loss).__name__ == "plain_loss"
    assert resolve_estimator(cfg.algorithm.adv_estimator).inputs == {"index"}
    assert get_reward_fn(cfg.algorithm.reward.name)("x", "abcd", None) == 4.0
    trainer = cfg.trainer.build(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    named = [cb for cb in trainer.callbacks if type(cb).__name__ in ("LearningRateMonitor", "CountSteps")]
    assert [type(cb).__name__ for cb in named] == ["LearningRateMonitor", "CountSteps"]
    assert named[1].every == 3 and calls == [3]


def test_a_file_loads_once_so_its_registrations_hold(user_file):
    """Resolving names in one file again returns the same objects (its decorator registers once)."""
    first = resolve_estimator(f"{user_file}:whitening")
    assert resolve_estimator(f"{user_file}:whitening").fn is first.fn
    assert first.whitens == "returns" and resolve_estimator("test_named_whitening").fn is first.fn
    torch.testing.assert_close(first(torch.ones(1, 2), torch.ones(1, 2))[1], torch.tensor([[2.0, 1.0]]))


def test_bad_names_fail_when_the_config_is_built(user_file, tmp_path):
    with pytest.raises(ValueError, match=r"policy_loss: policy loss .*NOT_A_FUNCTION.*not a callable"):
        PPOLossConfig(policy_loss=f"{user_file}:NOT_A_FUNCTION")
    with pytest.raises(ValueError, match=r"policy loss file '/nonexistent/x.py' does not exist"):
        PPOLossConfig(policy_loss="/nonexistent/x.py:f")
    with pytest.raises(ValueError, match=r"adv_estimator=.*has no attribute 'nope'"):
        load_config(GRPORecipeConfig, None, [f"algorithm.adv_estimator={user_file}:nope"])
    with pytest.raises(ValueError, match=r"callbacks\[0\]='Nope' is no built-in callback \(.*EarlyStopping"):
        load_config(GRPORecipeConfig, None, ["trainer.callbacks=[Nope]"])
    with pytest.raises(ValueError, match=r"trainer.callbacks\[0\]: 'EarlyStopping' cannot take init_args"):
        load_config(GRPORecipeConfig, None, ["trainer.callbacks=[{name: EarlyStopping, init_args: {x: 1}}]"])
    with pytest.raises(ValueError, match=r"callbacks\[0\]: callback 'no_such_module_x:C': cannot import"):
        load_config(GRPORecipeConfig, None, ["trainer.callbacks=['no_such_module_x:C']"])
