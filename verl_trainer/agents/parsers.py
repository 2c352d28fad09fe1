"""Tool-call parsers: the model's text of one turn -> the calls it makes.

A parser is a callable ``parse(text) -> list[ToolCall | MalformedToolCall]``, registered by format name
in :data:`TOOL_CALL_PARSERS` (config: ``algorithm.rollout.multi_turn.tool_call_format``). A call that is
present but unreadable (bad JSON, no name) is a :class:`MalformedToolCall`: the rollout answers it with an
error observation, so the model learns from it instead of the run stopping.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from verl_trainer.utils.registry import Registry

__all__ = ["TOOL_CALL_PARSERS", "MalformedToolCall", "ToolCall", "get_tool_call_parser", "parse_hermes"]


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's name and its arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MalformedToolCall:
    """A call the model tried to make but wrote unreadably; ``error`` says why (the observation)."""

    text: str
    error: str


ParsedCall = ToolCall | MalformedToolCall
ToolCallParser = Callable[[str], list[ParsedCall]]

TOOL_CALL_PARSERS: Registry[ToolCallParser] = Registry("tool-call format")
"""Tool-call parsers by format name (``"hermes"``: Qwen2.5 / Qwen3 / Hermes ``<tool_call>`` blocks)."""

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@TOOL_CALL_PARSERS.register("hermes")
def parse_hermes(text: str) -> list[ParsedCall]:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen2.5, Qwen3).

    ``arguments`` may also be a JSON string holding the object (some models write it so).
    """
    calls: list[ParsedCall] = []
    for body in _HERMES.findall(text):
        try:
            data = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(MalformedToolCall(body, f"the tool call is not valid JSON ({exc.msg})"))
            continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            calls.append(MalformedToolCall(body, 'a tool call is a JSON object with a "name" string'))
            continue
        arguments = data.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(arguments, dict):
            calls.append(MalformedToolCall(body, 'a tool call\'s "arguments" is a JSON object'))
            continue
        calls.append(ToolCall(data["name"], arguments))
    return calls


def get_tool_call_parser(format_or_parser: str | ToolCallParser) -> ToolCallParser:
    """A registered format's parser, or the callable itself.

    Raises:
        ValueError: An unknown format (the message lists the registered ones).
    """
    if callable(format_or_parser):
        return format_or_parser
    return TOOL_CALL_PARSERS.get(format_or_parser)
