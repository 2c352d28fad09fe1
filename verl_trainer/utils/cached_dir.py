"""Directories the project builds once and reuses — only while the settings that made them still hold.

A built directory (the recipes' tiny demo model, the warm-start policy) records the settings that made it
in its ownership marker (``verl_trainer.utils.fs``: ``settings``). :func:`is_current` says whether a
directory was built with exactly these settings; :func:`settings_difference` says, for a message, what
changed. Settings name their inputs by content: :func:`fingerprint` of a file or directory is its sha256
(files up to :data:`HASH_LIMIT` bytes) or size and modification time (larger ones, e.g. a model's weights),
so a cache is rebuilt when its input model or data changed, not only when a path did.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from verl_trainer.utils.fs import OWNER_MARKER, read_marker
from verl_trainer.utils.listing import first_of
from verl_trainer.utils.manifest import file_digest

__all__ = ["HASH_LIMIT", "fingerprint", "is_current", "normalize", "recorded_settings", "settings_difference"]

HASH_LIMIT = 64 * 2**20
"""Files up to this size are hashed; larger ones are keyed by size and modification time."""


def _file_key(path: Path) -> str:
    stat = path.stat()
    if stat.st_size <= HASH_LIMIT:
        return f"sha256:{file_digest(path)[1]}"
    return f"size:{stat.st_size},mtime_ns:{stat.st_mtime_ns}"


def fingerprint(path: str | os.PathLike) -> Any:
    """A JSON-able key of ``path``'s content: a file's key, a directory's ``{relative name: key}``.

    The project's marker is left out (it records the settings, not the content); a missing path is
    ``None``.
    """
    root = Path(path)
    if root.is_file():
        return _file_key(root)
    if not root.is_dir():
        return None
    return {p.relative_to(root).as_posix(): _file_key(p) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != OWNER_MARKER}


def normalize(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` as they read back from JSON (tuples become lists, other values strings)."""
    return json.loads(json.dumps(settings, sort_keys=True, default=str))


def recorded_settings(path: str | os.PathLike) -> dict[str, Any] | None:
    """The settings the directory's marker records (``None``: not the project's, or none recorded)."""
    marker = read_marker(path)
    settings = marker.get("settings") if marker else None
    return settings if isinstance(settings, dict) else None


def is_current(path: str | os.PathLike, settings: dict[str, Any]) -> bool:
    """Whether ``path`` was built by the project with exactly ``settings``."""
    return recorded_settings(path) == normalize(settings)


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flat(item, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): value}


def settings_difference(path: str | os.PathLike, settings: dict[str, Any]) -> str:
    """What differs between the settings ``path`` records and ``settings``, for a message."""
    old = recorded_settings(path)
    if old is None:
        return "it records no settings"
    before, after = _flat(old), _flat(normalize(settings))
    parts = []
    for key in sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k)):
        a, b = before.get(key), after.get(key)
        short = len(repr(a)) + len(repr(b)) < 60
        parts.append(f"{key}: {a!r} -> {b!r}" if short else f"{key} changed")
    return first_of(parts, 6, "; ")
