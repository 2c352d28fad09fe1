"""The tool interface: :class:`Tool`, :class:`ToolError` and :func:`settle`.

:class:`Tool` has verl's ``BaseTool`` life cycle; :func:`settle` gives the value of an ``async`` tool
method's coroutine. What a tool is made from is in :mod:`verl_trainer.agents.tools` (functions) and
:mod:`verl_trainer.agents.verl_tools` (verl's classes).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Mapping
from typing import Any

__all__ = ["Tool", "ToolError", "settle"]


class ToolError(Exception):
    """A tool call the tool refuses (bad arguments, a failed computation): its message is the observation."""


def settle(value: Any) -> Any:
    """``value``, or, when it is awaitable (an ``async`` tool's coroutine), what it resolves to.

    The awaitable runs in a new event loop on the calling thread (tool calls run on worker threads, which
    have no running loop).
    """
    if not inspect.isawaitable(value):
        return value

    async def wait() -> Any:
        return await value

    return asyncio.run(wait())


class Tool:
    """A tool with per-trajectory state (verl's ``BaseTool`` life cycle).

    Subclasses set :attr:`name` and implement :meth:`schema` and :meth:`execute`; :meth:`create`,
    :meth:`reward` and :meth:`release` default to no state and no reward. Calls for different
    trajectories may run concurrently (threads): keep per-trajectory state keyed by ``instance_id``.
    """

    name: str = ""

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema (``{"type": "function", "function": {...}}``)."""
        raise NotImplementedError

    def create(self, instance_id: str, row: Mapping[str, Any]) -> None:
        """A trajectory starts; ``row``: its prompt's ``ground_truth``, ``data_source``, ``extra_info``."""

    def execute(self, instance_id: str, arguments: dict[str, Any]) -> str:
        """Run one call; the returned text is the observation. Raise :class:`ToolError` for a refused call."""
        raise NotImplementedError

    def reward(self, instance_id: str) -> float:
        """This tool's reward for the trajectory (added to the environment's); default 0."""
        return 0.0

    def release(self, instance_id: str) -> None:
        """The trajectory ended: free its state."""
