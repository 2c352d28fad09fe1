"""verl's tool classes (``verl.tools.base_tool.BaseTool`` shape) and verl's tool YAML, run as :class:`Tool`.

A verl tool is built as ``cls(config, tool_schema)`` and has ``async`` (or plain) methods
``create(instance_id, **create_kwargs)``, ``execute(instance_id, parameters, **execute_kwargs)`` returning
``(response, step_reward, metrics)`` (``response``: text or an object with ``.text``, verl's
``ToolResponse``), ``calc_reward(instance_id, **kwargs) -> float`` and ``release(instance_id, **kwargs)``.
:class:`VerlTool` runs one: the per-sample keyword arguments come from the prompt row's
``extra_info["tools_kwargs"][<tool name>]`` (``create_kwargs``, ``execute_kwargs``, ``calc_reward_kwargs``,
``release_kwargs``), as in verl; ``calc_reward`` is the tool's trajectory reward; ``execute``'s step reward
and metrics are not used (verl's rollout does not add them to the reward either).

verl's tool file (``actor_rollout_ref.rollout.multi_turn.tool_config_path``; here
``algorithm.rollout.multi_turn.tool_config_path``)::

    tools:
      - class_name: my_pkg.my_tools.Lookup     # imported; or "path/to/file.py:Lookup"
        config: {type: native, table: words}   # the class's `config` argument
        tool_schema: {type: function, function: {name: lookup, description: ..., parameters: {...}}}
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from verl_trainer.agents.tool_base import Tool, settle
from verl_trainer.utils.registry import load_object

__all__ = ["ToolSchema", "VerlTool", "is_verl_tool", "load_tool_config"]


class ToolSchema(dict):
    """A tool schema as a dict that also reads as attributes (``schema.function.name``).

    verl's pydantic ``OpenAIFunctionToolSchema`` reads so; ``model_dump()`` gives the plain dict.
    """

    def __getattr__(self, key: str) -> Any:
        try:
            value = self[key]
        except KeyError:
            raise AttributeError(key) from None
        return ToolSchema(value) if isinstance(value, Mapping) else value

    def model_dump(self, **_: Any) -> dict[str, Any]:
        """The schema as a plain dict (pydantic's name)."""
        return dict(self)


def is_verl_tool(obj: Any) -> bool:
    """``obj`` is an instance of a verl-style tool class, not a :class:`Tool`.

    verl-style: it has ``execute`` and ``calc_reward`` or ``get_openai_tool_schema``.
    """
    return (not isinstance(obj, (type, Tool)) and callable(getattr(obj, "execute", None))
            and (callable(getattr(obj, "calc_reward", None))
                 or callable(getattr(obj, "get_openai_tool_schema", None))))


def _plain(schema: Any) -> dict[str, Any]:
    if hasattr(schema, "model_dump"):
        return dict(schema.model_dump(exclude_none=True) if not isinstance(schema, ToolSchema) else schema)
    if isinstance(schema, Mapping):
        return dict(schema)
    raise ValueError(f"a verl tool's schema is {type(schema).__name__}; give a mapping "
                     "{type: function, function: {name, description, parameters}}")


def _response_text(result: Any) -> str:
    """The observation in ``execute``'s return: ``(response, reward, metrics)``, ``ToolResponse`` or text."""
    if isinstance(result, tuple) and result:
        result = result[0]
    text = getattr(result, "text", result)
    return "" if text is None else str(text)


class VerlTool(Tool):
    """A verl-style tool object run as a :class:`Tool` (see the module docstring).

    Args:
        tool: The instance (built with its ``config`` and ``tool_schema``).

    Raises:
        ValueError: Its schema has no ``function.name``.
    """

    def __init__(self, tool: Any) -> None:
        getter = getattr(tool, "get_openai_tool_schema", None)
        schema = _plain(getter() if callable(getter) else getattr(tool, "tool_schema", None))
        name = schema.get("function", {}).get("name") if isinstance(schema.get("function"), Mapping) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"verl tool {type(tool).__name__}: its schema has no function.name ({schema}); "
                             "give tool_schema: {type: function, function: {name: ..., ...}}")
        self.tool, self.name, self._schema = tool, name, schema
        self._rows: dict[str, Mapping[str, Any]] = {}

    def schema(self) -> dict[str, Any]:
        """The tool's OpenAI function schema as a plain dict."""
        return self._schema

    def _kwargs(self, instance_id: str, stage: str) -> dict[str, Any]:
        extra = self._rows.get(instance_id, {}).get("extra_info")
        per_tool = (extra or {}).get("tools_kwargs", {}) if isinstance(extra, Mapping) else {}
        kwargs = per_tool.get(self.name, {}) if isinstance(per_tool, Mapping) else {}
        return dict(kwargs.get(f"{stage}_kwargs") or {}) if isinstance(kwargs, Mapping) else {}

    def create(self, instance_id: str, row: Mapping[str, Any]) -> None:
        """``tool.create(instance_id, **create_kwargs)`` (its return value is not used)."""
        self._rows[instance_id] = row
        if callable(getattr(self.tool, "create", None)):
            settle(self.tool.create(instance_id, **self._kwargs(instance_id, "create")))

    def execute(self, instance_id: str, arguments: dict[str, Any]) -> str:
        """``tool.execute(instance_id, arguments, **execute_kwargs)``'s response text."""
        return _response_text(settle(self.tool.execute(instance_id, arguments,
                                                       **self._kwargs(instance_id, "execute"))))

    def reward(self, instance_id: str) -> float:
        """``tool.calc_reward(instance_id, **calc_reward_kwargs)``; 0 without ``calc_reward``."""
        if not callable(getattr(self.tool, "calc_reward", None)):
            return 0.0
        return float(settle(self.tool.calc_reward(instance_id, **self._kwargs(instance_id, "calc_reward"))))

    def release(self, instance_id: str) -> None:
        """``tool.release(instance_id, **release_kwargs)``."""
        try:
            if callable(getattr(self.tool, "release", None)):
                settle(self.tool.release(instance_id, **self._kwargs(instance_id, "release")))
        finally:
            self._rows.pop(instance_id, None)


def _tool_class(class_name: Any, where: str) -> type:
    if not isinstance(class_name, str) or not class_name:
        raise ValueError(f"{where}.class_name={class_name!r}: give the class as 'package.module.Class' or "
                         "'path/to/file.py:Class'")
    spec = class_name if ":" in class_name else "{}:{}".format(*class_name.rsplit(".", 1)) \
        if "." in class_name else class_name
    cls = load_object(spec, "tool class")
    if not isinstance(cls, type):
        raise ValueError(f"{where}.class_name={class_name!r} is a {type(cls).__name__}, not a class")
    return cls


def load_tool_config(path: str | Path) -> list[Tool]:
    """The tools of a verl tool YAML (see the module docstring), each built as ``cls(config, tool_schema)``.

    A class that subclasses :class:`Tool` is built the same way and used as it is.

    Raises:
        ValueError: The file is missing or not a ``tools:`` list, an entry lacks ``class_name`` or
            ``tool_schema``, or a class does not load; the message names the entry and the fix.
    """
    file = Path(path)
    key = "algorithm.rollout.multi_turn.tool_config_path"
    if not file.is_file():
        raise ValueError(f"{key}={str(path)!r} does not exist; give verl's tool YAML "
                         "(tools: [{class_name, config, tool_schema}])")
    data = yaml.safe_load(file.read_text()) or {}
    entries = data.get("tools") if isinstance(data, Mapping) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{key}={str(path)!r} has no `tools:` list; verl's format is "
                         "tools: [{class_name: pkg.mod.Class, config: {...}, tool_schema: {...}}]")
    tools: list[Tool] = []
    for k, entry in enumerate(entries):
        where = f"{path} tools[{k}]"
        if not isinstance(entry, Mapping) or "tool_schema" not in entry:
            raise ValueError(f"{where} needs class_name and tool_schema (and optionally config); "
                             f"it is {entry!r}")
        cls = _tool_class(entry.get("class_name"), where)
        try:
            obj = cls(dict(entry.get("config") or {}), _schema_object(entry["tool_schema"]))
        except TypeError as exc:
            raise ValueError(f"{where}: {cls.__name__}(config, tool_schema) failed: {exc}; a verl tool "
                             "class takes (config, tool_schema)") from exc
        tools.append(obj if isinstance(obj, Tool) else VerlTool(obj))
    return tools


def _schema_object(schema: Any) -> Any:
    """``schema`` as verl's ``OpenAIFunctionToolSchema`` when verl is installed, else a :class:`ToolSchema`.

    A class that subclasses verl's ``BaseTool`` may rely on the pydantic object.
    """
    if not isinstance(schema, Mapping):
        raise ValueError(f"a tool_schema is a mapping {{type: function, function: {{...}}}}, not {schema!r}")
    try:
        from verl.tools.schemas import OpenAIFunctionToolSchema
    except ImportError:
        return ToolSchema(schema)
    return OpenAIFunctionToolSchema.model_validate(dict(schema))
