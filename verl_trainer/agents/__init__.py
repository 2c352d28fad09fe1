"""Agents: tools, tool-call parsers and environments for multi-turn rollouts (``docs/agents.md``).

The rollout side (:class:`verl_trainer.rollout.AgentLoop`) drives these; here is what a user writes or
names in ``algorithm.rollout.multi_turn``.
"""

from verl_trainer.agents.builtin_tools import calculator, python
from verl_trainer.agents.config import (
    MultiTurnConfig,
    prompt_tool_schemas,
    resolve_environment,
    resolve_tools,
)
from verl_trainer.agents.environment import Environment, StepResult
from verl_trainer.agents.parsers import (
    TOOL_CALL_PARSERS,
    MalformedToolCall,
    ToolCall,
    get_tool_call_parser,
    parse_hermes,
)
from verl_trainer.agents.template import ObservationEncoder
from verl_trainer.agents.tools import FunctionTool, Tool, ToolError, as_tool, settle
from verl_trainer.agents.verl_tools import VerlTool, load_tool_config

__all__ = [
    "TOOL_CALL_PARSERS",
    "Environment",
    "FunctionTool",
    "MalformedToolCall",
    "MultiTurnConfig",
    "ObservationEncoder",
    "StepResult",
    "Tool",
    "ToolCall",
    "ToolError",
    "VerlTool",
    "as_tool",
    "calculator",
    "get_tool_call_parser",
    "load_tool_config",
    "parse_hermes",
    "prompt_tool_schemas",
    "python",
    "resolve_environment",
    "resolve_tools",
    "settle",
]
