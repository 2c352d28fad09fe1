"""Tools a policy may call during a rollout: verl-style tool classes, and plain typed functions (TRL's way).

A :class:`Tool` lives for the whole run and serves many trajectories at once; each trajectory gets its own
instance id (verl's ``BaseTool``: ``create`` / ``execute`` / ``calc_reward`` / ``release``)::

    class Counter(Tool):
        name = "count"
        def schema(self) -> dict: ...              # the OpenAI function schema the chat template shows
        def create(self, instance_id, row): ...     # a trajectory starts (row: its prompt row)
        def execute(self, instance_id, arguments) -> str: ...
        def reward(self, instance_id) -> float: ... # added to the trajectory's reward
        def release(self, instance_id): ...         # the trajectory ended

A plain function with type hints and a Google docstring is a tool too (:class:`FunctionTool`): its schema
comes from ``transformers.utils.get_json_schema`` (transformers' chat-template tool support), its return
value (``str()``-ed) is the observation. :func:`as_tool` turns either into a :class:`Tool`.

``async def`` functions and ``async`` methods are tools too (TRL accepts both): each call's coroutine is run
to completion on the calling worker thread (:func:`settle`, a fresh event loop per call), under the same
time limit as a plain call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from transformers.utils import get_json_schema

from verl_trainer.agents.tool_base import Tool, ToolError, settle
from verl_trainer.agents.verl_tools import VerlTool, is_verl_tool

__all__ = ["FunctionTool", "Tool", "ToolError", "as_tool", "settle"]


class FunctionTool(Tool):
    """A plain typed function as a tool (TRL's ``tools=[fn]``).

    Args:
        fn: A function whose arguments have type hints and whose Google docstring describes it and each
            argument (what ``get_json_schema`` needs).

    Raises:
        ValueError: ``fn`` lacks the hints or docstring (the message says what is missing).
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        try:
            self._schema = get_json_schema(fn)
        except Exception as exc:  # transformers' DocstringParsingException / TypeHintParsingException
            raise ValueError(f"tool {getattr(fn, '__name__', fn)!r} cannot be described to the model: {exc}. "
                             "Give every argument a type hint and the function a Google docstring with an "
                             "Args: entry per argument") from exc
        self.fn = fn
        self.name = self._schema["function"]["name"]
        self._params = set(inspect.signature(fn).parameters)

    def schema(self) -> dict[str, Any]:
        """The schema ``get_json_schema`` derived from the hints and docstring."""
        return self._schema

    def execute(self, instance_id: str, arguments: dict[str, Any]) -> str:
        """Call the function with the model's arguments (unknown ones are a :class:`ToolError`)."""
        unknown = sorted(set(arguments) - self._params)
        if unknown:
            raise ToolError(f"{self.name} has no argument(s) {unknown}; its arguments are "
                            f"{sorted(self._params)}")
        try:
            return str(settle(self.fn(**arguments)))
        except TypeError as exc:  # missing / wrongly typed arguments
            raise ToolError(f"{self.name}: {exc}") from exc


def as_tool(obj: Any) -> Tool:
    """``obj`` as a :class:`Tool`.

    A ``Tool`` instance as is, a ``Tool`` subclass instantiated, a plain (or ``async``) function wrapped, a
    verl-style tool object (``execute`` / ``calc_reward``) adapted
    (:class:`~verl_trainer.agents.verl_tools.VerlTool`).

    Raises:
        ValueError: ``obj`` is none of these.
    """
    if isinstance(obj, Tool):
        tool = obj
    elif is_verl_tool(obj):
        tool = VerlTool(obj)
    elif isinstance(obj, type) and issubclass(obj, Tool):
        tool = obj()
    elif callable(obj) and inspect.isroutine(obj):
        tool = FunctionTool(obj)
    else:
        raise ValueError(f"{obj!r} is not a tool: give a typed function with a docstring, a Tool subclass, "
                         "a Tool instance or a verl tool instance (a verl tool class: list it in "
                         "multi_turn.tool_config_path's YAML, which gives it its config and tool_schema)")
    if not tool.name:
        raise ValueError(f"tool {obj!r} has no name; set the class attribute `name`")
    return tool
