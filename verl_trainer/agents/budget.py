"""Start-up check of the response budget: can one tool call fit in ``max_new_tokens`` at all?

A trajectory's tokens (model turns and tool results) share ``algorithm.rollout.max_new_tokens``. When it is
shorter than the shortest call the model could write, every turn is cut before its call closes, no tool
ever runs and the run trains on truncated calls without saying so. :func:`warn_if_no_call_fits` measures
each tool's shortest call (the Hermes text of a call with its required arguments set to the shortest
values of their types, plus the turn's end token) with the policy's tokenizer and warns.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING

from verl_trainer.agents.tools import Tool

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from verl_trainer.agents.parsers import ToolCallParser

__all__ = ["shortest_call_tokens", "warn_if_no_call_fits"]

_SHORTEST = {"string": "", "integer": 0, "number": 0, "boolean": True, "array": [], "object": {}}


def _shortest_call_text(tool: Tool) -> str:
    function = tool.schema().get("function", {})
    parameters = function.get("parameters") or {}
    properties = parameters.get("properties") or {}
    arguments = {name: _SHORTEST.get((properties.get(name) or {}).get("type"), None)
                 for name in parameters.get("required") or []}
    return "<tool_call>" + json.dumps({"name": tool.name, "arguments": arguments}) + "</tool_call>"


def shortest_call_tokens(tool: Tool, tokenizer: PreTrainedTokenizerBase) -> int:
    """Tokens of ``tool``'s shortest Hermes call and the turn's end token (the model must write both)."""
    return len(tokenizer.encode(_shortest_call_text(tool), add_special_tokens=False)) + 1


def warn_if_no_call_fits(tools: Iterable[Tool], tokenizer: PreTrainedTokenizerBase, max_new_tokens: int,
                         tool_call_format: str | ToolCallParser) -> None:
    """Warn (``UserWarning``) naming each tool whose shortest call is longer than ``max_new_tokens``.

    Only the ``hermes`` format is measured (another parser's call text is unknown here).
    """
    if tool_call_format != "hermes":
        return
    too_long = {t.name: n for t in tools if (n := shortest_call_tokens(t, tokenizer)) > max_new_tokens}
    if too_long:
        need = max(too_long.values())
        warnings.warn(f"algorithm.rollout.max_new_tokens={max_new_tokens} is shorter than the shortest call "
                      f"of the tool(s) {too_long} (tokens of the Hermes call with its required arguments "
                      "and the turn's end token): every turn is cut before such a call closes, so it never "
                      f"runs. Raise algorithm.rollout.max_new_tokens to at least {need} plus room for the "
                      "tool's result and the answer (it is the whole trajectory's budget)",
                      UserWarning, stacklevel=3)
