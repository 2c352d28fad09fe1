"""Tool-call parsers: the model's text of one turn -> the calls it makes.

A parser is a callable ``parse(text) -> list[ToolCall | MalformedToolCall]``, registered by format name
in :data:`TOOL_CALL_PARSERS` (config: ``algorithm.rollout.multi_turn.tool_call_format``). A call that is
present but unreadable (bad JSON, no name) is a :class:`MalformedToolCall`: the rollout answers it with an
error observation, so the model learns from it instead of the run stopping.

The policy under training writes anything: a parser must survive every text (any nesting depth, size,
lone surrogates, numbers past ``int``'s digit limit) in time linear in its length, and report what it cannot
read as :class:`MalformedToolCall` entries, never by raising. (The rollout also turns a user parser's
exception into one malformed call.)
"""

from __future__ import annotations

import json
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

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _blocks(text: str, open_tag: str, close_tag: str) -> list[str]:
    """The bodies of ``open_tag ... close_tag`` blocks, left to right; one pass (no regex backtracking)."""
    bodies = []
    start = text.find(open_tag)
    while start != -1:
        end = text.find(close_tag, start + len(open_tag))
        if end == -1:  # no complete block left
            break
        bodies.append(text[start + len(open_tag): end])
        start = text.find(open_tag, end + len(close_tag))
    return bodies


def _load_json(text: str) -> tuple[Any, str]:
    """``(value, "")`` or ``(None, why it is unreadable)``; never raises."""
    try:
        return json.loads(text), ""
    except json.JSONDecodeError as exc:
        return None, f"the tool call is not valid JSON ({exc.msg})"
    except RecursionError:
        return None, "the tool call's JSON is nested too deeply"
    except ValueError as exc:  # an integer past sys.get_int_max_str_digits()
        return None, f"the tool call's JSON is unreadable ({str(exc)[:80]})"


@TOOL_CALL_PARSERS.register("hermes")
def parse_hermes(text: str) -> list[ParsedCall]:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen2.5, Qwen3).

    ``arguments`` may also be a JSON string holding the object (some models write it so). An opening tag
    without a closing one is not a call (the text around it is the answer).

    Returns:
        One :class:`ToolCall` or :class:`MalformedToolCall` per block, in order. Never raises (see the
        module docstring); linear in ``len(text)``.
    """
    calls: list[ParsedCall] = []
    for body in _blocks(text, _OPEN, _CLOSE):
        data, error = _load_json(body)
        if error:
            calls.append(MalformedToolCall(body, error))
            continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            calls.append(MalformedToolCall(body, 'a tool call is a JSON object with a "name" string'))
            continue
        arguments = data.get("arguments", {})
        if isinstance(arguments, str):
            arguments, error = _load_json(arguments)
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
