"""The agent interface: typed functions and tool classes as tools, the Hermes parser, the built-in tools,
and the multi-turn config (errors before any model loads)."""

from __future__ import annotations

import pytest

from verl_trainer.agents import (
    FunctionTool,
    MalformedToolCall,
    MultiTurnConfig,
    Tool,
    ToolCall,
    ToolError,
    as_tool,
    calculator,
    parse_hermes,
    python,
    resolve_environment,
    resolve_tools,
)
from verl_trainer.recipe_config import GRPORecipeConfig, load_config


def word_count(text: str, minimum: int = 1) -> int:
    """Count the words of a text.

    Args:
        text: The text.
        minimum: Only words of at least this many characters count.
    """
    return sum(len(w) >= minimum for w in text.split())


def test_a_typed_function_is_a_tool_with_the_chat_template_schema():
    tool = as_tool(word_count)
    assert isinstance(tool, FunctionTool) and tool.name == "word_count"
    params = tool.schema()["function"]["parameters"]
    assert params["properties"]["text"] == {"type": "string", "description": "The text."}
    assert params["required"] == ["text"]
    assert tool.execute("t", {"text": "a bb ccc", "minimum": 2}) == "2"
    with pytest.raises(ToolError, match=r"no argument\(s\) \['words'\]"):
        tool.execute("t", {"words": "x"})


def test_a_function_without_docstring_is_refused_with_the_fix():
    def bare(x):
        return x

    with pytest.raises(ValueError, match="type hint.*Google docstring"):
        as_tool(bare)
    with pytest.raises(ValueError, match="is not a tool"):
        as_tool(42)


def test_hermes_parser_reads_calls_and_reports_malformed_ones():
    text = ('<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}</tool_call>'
            '<tool_call>{not json}</tool_call><tool_call>{"arguments": {}}</tool_call>')
    calls = parse_hermes(text)
    assert calls[:2] == [ToolCall("calculator", {"expression": "2+3"}),
                         ToolCall("calculator", {"expression": "1"})]
    assert isinstance(calls[2], MalformedToolCall) and "not valid JSON" in calls[2].error
    assert isinstance(calls[3], MalformedToolCall) and '"name"' in calls[3].error
    assert parse_hermes("no call here") == []


def test_calculator_evaluates_without_eval_and_refuses_the_rest():
    assert calculator("(12+7)*3") == "57"
    assert calculator("7/2") == "3.5"
    assert calculator("-2**3") == "-8"
    for bad, message in [("__import__('os')", "unsupported"), ("1/0", "division by zero"),
                         ("2**1000", "too large"), ("1+", "cannot parse")]:
        with pytest.raises(ToolError, match=message):
            calculator(bad)


def test_python_tool_runs_in_the_sandbox():
    assert python("print(6*7)") == "42\n"
    with pytest.raises(ToolError, match="(?s)exit status 1:.*ZeroDivisionError"):
        python("1/0")


class Counter(Tool):
    """A tool class with per-trajectory state."""

    name = "count"

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def schema(self) -> dict:
        return {"type": "function", "function": {"name": "count", "description": "count calls",
                                                 "parameters": {"type": "object", "properties": {}}}}

    def create(self, instance_id, row):
        self.counts[instance_id] = 0

    def execute(self, instance_id, arguments):
        self.counts[instance_id] += 1
        return str(self.counts[instance_id])

    def reward(self, instance_id):
        return float(self.counts[instance_id])

    def release(self, instance_id):
        del self.counts[instance_id]


def test_tools_and_environments_load_from_files_like_rewards(tmp_path):
    file = tmp_path / "my_tools.py"
    file.write_text(
        "from verl_trainer.agents import Environment, StepResult\n"
        "def shout(text: str) -> str:\n"
        '    """Upper-case a text.\n\n    Args:\n        text: The text.\n    """\n'
        "    return text.upper()\n"
        "class Echo(Environment):\n"
        "    def step(self, message):\n"
        "        return StepResult(message, 1.0, True)\n"
    )
    tools = resolve_tools([f"{file}:shout", "verl_trainer.agents.builtin_tools:calculator", Counter])
    assert [t.name for t in tools] == ["shout", "calculator", "count"]
    assert tools[0].execute("i", {"text": "hi"}) == "HI"
    env = resolve_environment(f"{file}:Echo")()
    assert env.step("x").reward == 1.0
    with pytest.raises(ValueError, match="tool .*has no attribute 'nope'"):
        resolve_tools([f"{file}:nope"])
    with pytest.raises(ValueError, match="tool file .*does not exist"):
        resolve_tools(["missing.py:fn"])
    with pytest.raises(ValueError, match="not a subclass of verl_trainer.agents.Environment"):
        resolve_environment(dict)
    with pytest.raises(ValueError, match=r"several tools are named \['calculator'\]"):
        resolve_tools([calculator, calculator])


def test_multi_turn_yaml_errors_name_the_value_and_the_fix(tmp_path):
    key = "algorithm.rollout.multi_turn"
    base = [f"algorithm.model_path={tmp_path}", f"{key}.enable=true"]
    tools = f"{key}.tools=[verl_trainer.agents:calculator]"
    cfg = load_config(GRPORecipeConfig, None, [*base, tools, f"{key}.max_turns=3"])
    assert cfg.algorithm.rollout.multi_turn.max_turns == 3
    for override, message in [
        (f"{key}.tool_call_format=json", "tool_call_format='json' is unknown; choose one of 'hermes'"),
        (f"{key}.max_turns=0", "max_turns=0 must be >= 1"),
        (f"{key}.tools=[nowhere.py:fn]", "tool file 'nowhere.py' does not exist"),
        (f"{key}.tool_timeout_s=0", r"tool_timeout_s=0.0 must be a number of seconds in \(0, inf\)"),
        (f"{key}.environment_timeout_s=-1", r"environment_timeout_s=-1.0 must be a number of seconds in"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_config(GRPORecipeConfig, None, [*base, tools, override])
    with pytest.raises(ValueError, match="no tools and no environment"):
        load_config(GRPORecipeConfig, None, base)
    assert MultiTurnConfig(enable=True, tools=[word_count]).tools == [word_count]  # objects from Python


def test_the_grpo_tools_config_loads_with_the_calculator():
    from pathlib import Path

    cfg = load_config(GRPORecipeConfig, Path(__file__).resolve().parents[2] / "configs" / "grpo_tools.yaml")
    multi_turn = cfg.algorithm.rollout.multi_turn
    assert multi_turn.enable and [t.name for t in resolve_tools(multi_turn.tools)] == ["calculator"]
    assert cfg.task.arithmetic.chat and cfg.algorithm.rollout.max_new_tokens == 160
