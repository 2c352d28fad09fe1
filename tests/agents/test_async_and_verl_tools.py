"""``async def`` tools (TRL's ``tools=`` accepts them) and verl-style tool classes (async ``create`` /
``execute`` / ``calc_reward`` / ``release``, loaded from verl's tool YAML) run in a real HF rollout: the
observations are the tools' answers, under the same time limit as plain tools."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from tests.agents.common import QUESTIONS, tool_policy
from tests.agents.test_bounded_agents import generate
from verl_trainer.agents import MultiTurnConfig, load_tool_config, prompt_tool_schemas
from verl_trainer.data.prompts import PromptDataset, to_verl_row
from verl_trainer.models.loading import load_tokenizer
from verl_trainer.rollout import AGENT_INFO, RolloutConfig, build_rollout

ASYNC_TOOLS = '''
import asyncio

async def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. "2+3".
    """
    await asyncio.sleep(0.01)
    a, b = expression.split("+")
    return f"sum={int(a) + int(b)}"

async def slow(expression: str) -> str:
    """Never answers in time.

    Args:
        expression: Anything.
    """
    await asyncio.sleep(3600)
'''

VERL_TOOL = '''
import asyncio
from dataclasses import dataclass

@dataclass
class ToolResponse:      # verl's ToolResponse has .text (and .image / .video)
    text: str | None = None

class Calculator:        # verl's BaseTool shape: (config, tool_schema), async life cycle
    def __init__(self, config, tool_schema):
        self.config, self.tool_schema = config, tool_schema
        self.name = tool_schema.function.name
        self.calls = {}

    def get_openai_tool_schema(self):
        return self.tool_schema

    async def create(self, instance_id=None, **kwargs):
        self.calls[instance_id] = {"bonus": kwargs.get("bonus", 0.0), "answers": []}
        return instance_id, ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(0)
        a, b = parameters["expression"].split("+")
        answer = int(a) + int(b)
        self.calls[instance_id]["answers"].append(answer)
        return ToolResponse(text=f"{self.config['prefix']}{answer}"), 0.5, {"ok": 1}

    async def calc_reward(self, instance_id, **kwargs):
        return self.calls[instance_id]["bonus"] + len(self.calls[instance_id]["answers"])

    async def release(self, instance_id, **kwargs):
        del self.calls[instance_id]
'''

SCHEMA = {"type": "function", "function": {
    "name": "calculator", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> str:
    return tool_policy(tmp_path_factory.mktemp("tool_policy") / "model")


def tool_messages(batch) -> list[str]:
    return [m["content"] for info in batch[AGENT_INFO] for m in info["messages"] if m["role"] == "tool"]


def test_an_async_tool_runs_and_its_result_is_the_observation(policy, tmp_path):
    (tmp_path / "tools.py").write_text(ASYNC_TOOLS)
    multi_turn = MultiTurnConfig(enable=True, tools=[f"{tmp_path}/tools.py:calculator"])
    batch, _ = generate(policy, multi_turn)
    assert tool_messages(batch) == ["sum=5", "sum=8"]  # 2+3, 4+4: the coroutine ran, no "<coroutine"
    assert all(info["tool_errors"] == 0 for info in batch[AGENT_INFO])


def test_an_async_tool_past_its_limit_is_a_timeout_observation(policy, tmp_path):
    (tmp_path / "tools.py").write_text(ASYNC_TOOLS.replace("async def slow", "async def _slow")
                                       .replace("async def calculator", "async def fast")
                                       .replace("async def _slow", "async def calculator"))
    multi_turn = MultiTurnConfig(enable=True, tools=[f"{tmp_path}/tools.py:calculator"], tool_timeout_s=0.5)
    batch, seconds = generate(policy, multi_turn)
    assert seconds < 20
    assert tool_messages(batch) == ["Error: the tool call ran past 0.5 s and was abandoned"] * 2
    assert [info["tool_timeouts"] for info in batch[AGENT_INFO]] == [1, 1]


def write_tool_yaml(tmp_path, class_name: str) -> str:
    path = tmp_path / "tool_config.yaml"
    path.write_text(yaml.safe_dump({"tools": [{"class_name": class_name, "config": {"type": "native",
                                                                                     "prefix": "= "},
                                               "tool_schema": SCHEMA}]}))
    return str(path)


def test_a_verl_tool_class_from_verl_tool_yaml_runs_its_async_life_cycle(policy, tmp_path, monkeypatch):
    (tmp_path / "my_verl_tools.py").write_text(VERL_TOOL)
    monkeypatch.syspath_prepend(str(tmp_path))  # verl's class_name is an importable dotted path
    config = write_tool_yaml(tmp_path, "my_verl_tools.Calculator")
    multi_turn = MultiTurnConfig(enable=True, tool_config_path=config)
    assert prompt_tool_schemas(multi_turn) == [SCHEMA]  # the prompt shows the YAML's schema
    rows = [to_verl_row([{"role": "user", "content": q}], "", "arithmetic",
                        {"tools_kwargs": {"calculator": {"create_kwargs": {"bonus": bonus}}}})
            for q, bonus in zip(QUESTIONS[:2], (0.0, 10.0))]  # verl's per-sample create_kwargs
    rollout = build_rollout(RolloutConfig(device="cpu", max_new_tokens=200, do_sample=False,
                                          multi_turn=multi_turn), policy)
    batch = rollout.generate(PromptDataset(rows, load_tokenizer(policy)))
    assert tool_messages(batch) == ["= 5", "= 8"]  # ToolResponse.text of (response, reward, metrics)
    assert [info["reward"] for info in batch[AGENT_INFO]] == [1.0, 11.0]  # calc_reward: bonus + 1 call
    assert all(info["tool_errors"] == 0 for info in batch[AGENT_INFO])


def test_verl_tool_yaml_errors_name_the_entry_and_the_fix(tmp_path):
    (tmp_path / "my_verl_tools.py").write_text(VERL_TOOL)
    [tool] = load_tool_config(write_tool_yaml(tmp_path, f"{tmp_path}/my_verl_tools.py:Calculator"))
    assert tool.name == "calculator" and tool.schema() == SCHEMA
    with pytest.raises(ValueError, match=r"tool_config_path='.*nope.yaml' does not exist"):
        MultiTurnConfig(enable=True, tool_config_path=str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"tools": [{"class_name": "my_verl_tools.Calculator"}]}))
    with pytest.raises(ValueError, match=r"tools\[0\] needs class_name and tool_schema"):
        load_tool_config(bad)
    bad.write_text(textwrap.dedent("""
        tools:
          - class_name: no_such_module_xyz.Tool
            tool_schema: {type: function, function: {name: x}}
    """))
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        load_tool_config(bad)
