"""PPO's critic as stage parts that hold no module; a user's overrides still plugged in as parts."""

import torch
from tensordict import TensorDict

from verl_trainer.algorithms import GRPO, PPO
from verl_trainer.algorithms.config import GRPOConfig, PPOConfig
from verl_trainer.algorithms.critic import CriticAdvantages, CriticUpdates, CriticWarmup
from verl_trainer.algorithms.rl import ActorDueOverride, RLModule
from verl_trainer.algorithms.stages.signal import EstimatorAdvantages, keep_all


class _Engine:
    """Stands in for an engine: the parts only hold it here."""


def _ppo(cls=PPO, **kwargs):
    module = cls(PPOConfig(**kwargs))
    module.engines = {"actor": _Engine(), "critic": _Engine()}
    return module


def _holds(part, module) -> bool:
    """Whether ``part`` reaches ``module``: as a bound method or through one of its attributes."""
    if getattr(part, "__self__", None) is module:
        return True
    return any(value is module or getattr(value, "__self__", None) is module
               for value in vars(part).values()) if hasattr(part, "__dict__") else False


def test_ppo_plugs_critic_parts_that_hold_no_module():
    module = _ppo()
    compute, select = module.advantage_parts()
    due, critic = module.update_parts()
    assert isinstance(compute, CriticAdvantages) and select is keep_all
    assert isinstance(due, CriticWarmup) and isinstance(critic, CriticUpdates)
    assert compute.critic is module.engines["critic"] and critic.critic is module.engines["critic"]
    assert not any(_holds(part, module) for part in (compute, select, due, critic))


def test_critic_warmup_keeps_the_actor_out_of_the_first_steps():
    warmup = CriticWarmup(2)
    assert [warmup(step) for step in range(4)] == [False, False, True, True]
    assert CriticWarmup(0)(0)


def test_grpo_plugs_parts_that_hold_no_module():
    module = GRPO(GRPOConfig(dynamic_sampling=True))
    compute, select = module.advantage_parts()
    assert isinstance(compute, EstimatorAdvantages)
    assert module.update_parts() == (None, None)
    assert not any(_holds(part, module) for part in (compute, select))


def test_a_subclass_override_of_ppo_is_plugged_in():
    class MyPPO(PPO):
        def compute_advantages(self, batch, scores, metrics):
            metrics["mine"] = 1.0

        def actor_update_due(self):
            return False

        def update_critic(self, mini_batches):
            return {"critic/mine": len(mini_batches)}

    module = _ppo(MyPPO)
    compute, _ = module.advantage_parts()
    due, critic = module.update_parts()
    metrics = {}
    compute(TensorDict({}, batch_size=[0]), torch.zeros(0), metrics)
    assert metrics == {"mine": 1.0}
    assert isinstance(due, ActorDueOverride) and due(10) is False
    assert critic([1, 2]) == {"critic/mine": 2}


def test_an_rl_module_subclass_gets_its_overrides_as_parts():
    class Mine(RLModule):
        def compute_advantages(self, batch, scores, metrics):
            metrics["mine"] = 1.0

        def select_samples(self, batch, scores, metrics):
            return batch, False

    module = Mine(GRPOConfig())
    _, select = module.advantage_parts()
    assert select(None, None, {}) == (None, False)
    assert module.update_parts() == (None, None)
