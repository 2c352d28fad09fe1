"""``calculator_call_credit``: the tools demo's shaped reward (``verl_trainer/agents/tool_rewards.py``)."""

from __future__ import annotations

import json

import pytest

from verl_trainer.agents.tool_rewards import CALL_CREDIT, calculator_call_credit
from verl_trainer.rewards import get_reward_fn


def _call(expression, name="calculator"):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': {'expression': expression}})}</tool_call>"


@pytest.mark.parametrize(("text", "score", "acc", "right_call"), [
    (_call("12*34") + "\n408\n408", 1.0, 1.0, 1.0),          # right call, right answer
    (_call("12*34") + "\n408\n480", CALL_CREDIT, 0.0, 1.0),  # right call, result copied wrong
    (_call("34*12") + "\n408\n4O8", CALL_CREDIT, 0.0, 1.0),  # any expression of the right value
    (_call("12*43") + "\n516\n516", 0.0, 0.0, 0.0),          # wrong operands
    (_call("12*34", name="lookup") + "\nError\n7", 0.0, 0.0, 0.0),  # another tool
    (_call("12*") + "\nError\n", 0.0, 0.0, 0.0),             # refused by the calculator
    ("<tool_call>{not json}</tool_call>\n7", 0.0, 0.0, 0.0),  # malformed
    ("408", 1.0, 1.0, 0.0),                                   # answered without the tool: math_exact's 1
    ("", 0.0, 0.0, 0.0),
])
def test_credit_for_a_right_call_and_full_score_for_the_right_answer(text, score, acc, right_call):
    got = calculator_call_credit("arithmetic", text, "408")
    assert got == {"score": score, "acc": acc, "right_call": right_call}


def test_loads_by_its_module_path_as_the_demo_config_names_it():
    fn = get_reward_fn("verl_trainer.agents.tool_rewards:calculator_call_credit")
    assert fn("arithmetic", _call("2*3") + "\n6\n5", "6")["score"] == CALL_CREDIT
