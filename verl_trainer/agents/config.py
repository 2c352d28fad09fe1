"""``algorithm.rollout.multi_turn``: the typed settings of multi-turn, tool-calling rollouts."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from verl_trainer.agents.environment import Environment
from verl_trainer.agents.parsers import TOOL_CALL_PARSERS
from verl_trainer.agents.tools import Tool, as_tool
from verl_trainer.agents.verl_tools import load_tool_config
from verl_trainer.rewards.sandbox import check_sandbox
from verl_trainer.serving.agent_spec import check_agent_config
from verl_trainer.serving.config import ServerConfig
from verl_trainer.utils.registry import load_object

__all__ = ["MultiTurnConfig", "prompt_tool_schemas", "resolve_environment", "resolve_tools"]


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts: the policy calls tools / talks to an environment until done.

    Attributes:
        enable: Turn multi-turn rollouts on (off: one response per prompt, as before).
        max_turns: Most assistant turns per trajectory.
        max_tool_response_length: Characters of one tool's output kept (the rest is cut, marked ``...``).
        tool_timeout_s: Wall-clock seconds a turn's tool calls may take; a call still running then is
            answered with a timeout error observation (counted as ``agent/tool_timeouts``). A tool's
            ``create`` / ``reward`` / ``release`` calls have the same limit.
        environment_timeout_s: Wall-clock seconds one environment call (construction and ``reset``, a
            ``step``, ``close``) may take; past it the trajectory ends there with that step's reward 0
            (counted as ``agent/env_timeouts``). Tool and environment calls run on daemon threads
            (:mod:`verl_trainer.utils.daemon_calls`): a call past its limit is abandoned, never waited for.
        tool_call_format: The parser of the model's tool calls (``"hermes"``:
            ``<tool_call>{json}</tool_call>`` of Qwen / Hermes chat templates), or (in Python) a parser
            callable.
        tools: Tools as ``"file.py:name"`` / ``"module:name"`` (like reward functions) naming a typed
            function (plain or ``async``), a :class:`~verl_trainer.agents.Tool` subclass or instance; or (in
            Python) the objects, verl-style tool instances included.
        tool_config_path: verl's tool YAML (``tools: [{class_name, config, tool_schema}]``), its classes
            built as ``cls(config, tool_schema)`` (:mod:`verl_trainer.agents.verl_tools`); added to ``tools``.
        environment: An :class:`~verl_trainer.agents.Environment` subclass (``"file.py:Name"`` or the class);
            ``None``: none (a turn without a tool call ends the trajectory).
        reward_weight: Weight of the trajectory's environment + tool reward, added to the reward functions'
            score (``algorithm.reward.name``).
        tools_in_prompt: Render the tools' JSON schemas into every prompt through the chat template
            (``apply_chat_template(..., tools=...)``, transformers' tool use), so the model sees them; off:
            the prompts describe the tools themselves (or a warm-started model knows them).
        agent: An external agent (``"file.py:fn"`` / ``"module:fn"`` or the function) that runs each
            trajectory through the OpenAI-compatible token server and returns its reward
            (:mod:`verl_trainer.serving.agent_loop`); it replaces ``tools`` and ``environment``.
        agent_timeout_s: The longest one agent call (a whole trajectory) may take.
        server: The token server's address and limits (:class:`~verl_trainer.serving.ServerConfig`).
    """

    enable: bool = False
    max_turns: int = 4
    max_tool_response_length: int = 256
    tool_timeout_s: float = 10.0
    environment_timeout_s: float = 30.0
    tool_call_format: Any = "hermes"
    tools: list[Any] = field(default_factory=list)
    tool_config_path: str | None = None
    environment: Any = None
    reward_weight: float = 1.0
    tools_in_prompt: bool = True
    agent: Any = None
    agent_timeout_s: float = 300.0
    server: ServerConfig = field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        where = "algorithm.rollout.multi_turn"
        if self.max_turns < 1:
            raise ValueError(f"{where}.max_turns={self.max_turns} must be >= 1 "
                             "(assistant turns per trajectory)")
        if self.max_tool_response_length < 1:
            raise ValueError(f"{where}.max_tool_response_length={self.max_tool_response_length} must be >= 1")
        if isinstance(self.server, dict):
            self.server = ServerConfig(**self.server)
        for key in ("tool_timeout_s", "environment_timeout_s", "agent_timeout_s"):
            value = getattr(self, key)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (number and 0 < value < math.inf):
                raise ValueError(f"{where}.{key}={value!r} must be a number of seconds in (0, inf) (default "
                                 f"{getattr(type(self), key):g}); set it to the longest a call may take")
        if not callable(self.tool_call_format) and self.tool_call_format not in TOOL_CALL_PARSERS:
            raise ValueError(f"{where}.tool_call_format={self.tool_call_format!r} is unknown; choose one of "
                             f"{TOOL_CALL_PARSERS.keys_repr()} or register a parser in "
                             "verl_trainer.agents.TOOL_CALL_PARSERS")
        if self.enable and self.agent is not None:  # an external agent: its own checks
            check_agent_config(self)
            return
        if self.enable:  # load the user's code now: a bad name fails before any model loads
            resolve_tools(self.tools, self.tool_config_path)
            resolve_environment(self.environment)
            if not self.tools and not self.tool_config_path and self.environment is None:
                raise ValueError(f"{where}.enable=true with no tools and no environment: name tools "
                                 f"({where}.tools=[path/to/tools.py:fn]) or an environment")


def resolve_tools(specs: list[Any], tool_config_path: str | None = None) -> list[Tool]:
    """The :class:`Tool` objects ``specs`` name, then those of verl's tool YAML ``tool_config_path``.

    Strings in ``specs`` are loaded with the reward loader.

    A tool that runs model-written code (its function or class has ``uses_sandbox = True``, like the
    built-in ``python``) makes the sandbox check its isolation tool here.

    Raises:
        ValueError: A name that does not load, an object that is not a tool, or two tools of one name.
        SandboxUnavailableError: A tool uses the sandbox and no isolation tool can run here.
    """
    tools: list[Tool] = []
    for spec in specs:
        obj = load_object(spec, "tool") if isinstance(spec, str) else spec
        tools.append(as_tool(obj))
    if tool_config_path:
        tools.extend(load_tool_config(tool_config_path))
    if any(getattr(getattr(t, "fn", t), "uses_sandbox", False) for t in tools):
        check_sandbox()  # model-written code will run: refuse now (or warn, VERL_SANDBOX=none), not mid-run
    names = [t.name for t in tools]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"algorithm.rollout.multi_turn.tools: several tools are named {duplicates}; "
                         "tool names must be unique")
    return tools


def prompt_tool_schemas(config: MultiTurnConfig) -> list[dict[str, Any]] | None:
    """The JSON schemas the prompts show (``tools=`` of the chat template), or ``None``.

    ``None`` when multi-turn is off, ``tools_in_prompt`` is off or there are no tools.
    """
    if not (config.enable and config.tools_in_prompt and (config.tools or config.tool_config_path)):
        return None
    return [tool.schema() for tool in resolve_tools(config.tools, config.tool_config_path)]


def resolve_environment(spec: str | Callable[[], Environment] | None) -> Callable[[], Environment] | None:
    """The environment class (or zero-argument factory) ``spec`` names; ``None`` for none.

    Raises:
        ValueError: A name that does not load, or an object that is neither an ``Environment`` subclass
            nor a callable.
    """
    if spec is None or spec == "":
        return None
    obj = load_object(spec, "environment") if isinstance(spec, str) else spec
    if isinstance(obj, type) and not issubclass(obj, Environment):
        raise ValueError(f"environment {spec!r} is the class {obj.__name__}, not a subclass of "
                         "verl_trainer.agents.Environment")
    if not callable(obj):
        raise ValueError(f"environment {spec!r} is a {type(obj).__name__}; give an Environment subclass")
    return obj
