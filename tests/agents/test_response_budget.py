"""A ``max_new_tokens`` too small for one tool call warns when the rollout is built (it would silently
train on calls cut before they close), naming the tools, the tokens needed and the setting."""

from __future__ import annotations

import warnings

import pytest

from verl_trainer.agents import MultiTurnConfig, calculator
from verl_trainer.agents.budget import shortest_call_tokens
from verl_trainer.agents.tools import as_tool
from verl_trainer.models import make_tiny_model
from verl_trainer.models.loading import load_tokenizer
from verl_trainer.rollout import RolloutConfig, build_rollout


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("budget") / "model", hidden_size=16, num_attention_heads=2,
                           num_key_value_heads=1)


def rollout(model: str, max_new_tokens: int):
    return build_rollout(RolloutConfig(device="cpu", max_new_tokens=max_new_tokens,
                                       multi_turn=MultiTurnConfig(enable=True, tools=[calculator])), model)


def test_a_budget_shorter_than_one_call_warns_at_start_up(model):
    need = shortest_call_tokens(as_tool(calculator), load_tokenizer(model))
    assert need > 40  # the character tokenizer: '<tool_call>{"name": "calculator", ...' letter by letter
    message = (rf"algorithm.rollout.max_new_tokens=16 is shorter than the shortest call of the tool\(s\) "
               rf"\{{'calculator': {need}\}}.*at least {need}")
    with pytest.warns(UserWarning, match=message):
        rollout(model, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # room for a call: no warning
        rollout(model, need + 32)
