"""A shaped reward for calculator tool use: credit for a call whose result is the answer.

``math_exact`` pays 1 only when the trajectory's final number is the ground truth, so a policy that calls
the calculator with the right expression but copies the result wrong scores the same 0 as one that calls
it with the wrong operands. :func:`calculator_call_credit` tells the two apart: the right call earns
``CALL_CREDIT`` (0.5) even when the answer after it is wrong, which gives GRPO a signal on the first half
of the task (copying the question into the call) while the second half (copying the result) is still
unreliable. Use it as ``algorithm.reward.name: verl_trainer.agents.tool_rewards:calculator_call_credit``
(``configs/grpo_tools.yaml``); its ``acc`` is ``math_exact``'s, logged as ``reward/accuracy`` and
``val/reward/accuracy``: the rate of right final answers, unshaped.
"""

from __future__ import annotations

from typing import Any

from verl_trainer.agents.builtin_tools import calculator
from verl_trainer.agents.parsers import ToolCall, parse_hermes
from verl_trainer.agents.tool_base import ToolError
from verl_trainer.rewards.rule_based import answers_match, math_exact

CALL_CREDIT = 0.5
"""Score of a trajectory whose final answer is wrong but which called the calculator on an expression
whose value is the ground truth."""


def right_calculator_call(solution_str: str, ground_truth: Any) -> bool:
    """Whether any Hermes ``calculator`` call in the text evaluates to ``ground_truth``.

    The calls are parsed as the rollout parses them (:func:`~verl_trainer.agents.parsers.parse_hermes`)
    and evaluated by the built-in calculator; a malformed call, another tool, a missing or non-string
    ``expression`` and an expression the calculator refuses count as not right.
    """
    for call in parse_hermes(solution_str):
        if not isinstance(call, ToolCall) or call.name != "calculator":
            continue
        expression = call.arguments.get("expression")
        if not isinstance(expression, str):
            continue
        try:
            value = calculator(expression)
        except (ToolError, ArithmeticError, ValueError, OverflowError, RecursionError):
            continue
        if answers_match(value, ground_truth):
            return True
    return False


def calculator_call_credit(data_source: str, solution_str: str, ground_truth: Any,
                           extra_info: dict | None = None) -> dict[str, float]:
    """1 for the right final answer, else ``CALL_CREDIT`` for a right calculator call, else 0.

    Args:
        data_source: The row's ``data_source`` (not used: the task is the calculator's).
        solution_str: The whole trajectory's text (model turns and tool results; the rollout passes it so).
        ground_truth: The answer.
        extra_info: The row's ``extra_info`` (passed on to ``math_exact``).

    Returns:
        ``{"score": s, "acc": a, "right_call": c}``: ``a`` is ``math_exact``'s score (the final number
        equals the ground truth), ``c`` 1 when a calculator call evaluates to the ground truth,
        ``s = max(a, CALL_CREDIT * c)``.
    """
    exact = math_exact(data_source, solution_str, ground_truth, extra_info)["acc"]
    call = float(right_calculator_call(solution_str, ground_truth))
    return {"score": max(exact, CALL_CREDIT * call), "acc": exact, "right_call": call}
