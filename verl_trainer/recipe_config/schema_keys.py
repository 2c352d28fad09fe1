"""Walking a config schema (nested dataclasses) by dotted key.

The one walker that the config loader's error messages and the verl-key aliases share.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["MISSING", "default_at"]

MISSING = object()
"""What :func:`default_at` returns for a key the schema does not have."""


def default_at(schema: Any, dotted: str) -> Any:
    """The default value at ``dotted`` in ``schema``, or :data:`MISSING` when there is no such key.

    Nested configs are built from their defaults on the way down; ``""`` is the schema itself.
    """
    node: Any = schema
    for part in (p for p in dotted.split(".") if p):
        fields = {f.name: f for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else {}
        if part not in fields:
            return MISSING
        field = fields[part]
        if field.default_factory is not dataclasses.MISSING:
            node = field.default_factory()
        else:
            node = field.default
    return node
