"""The local Hugging Face hub cache: where it is and what names a hub id (models and datasets alike)."""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["hub_cache_dir", "looks_like_hub_id"]

_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9_.-]*/)?[A-Za-z0-9][A-Za-z0-9_.-]*$")


def hub_cache_dir() -> Path:
    """The HF hub cache as transformers finds it now: ``HF_HUB_CACHE``, ``HF_HOME/hub`` or the default."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def looks_like_hub_id(path: str) -> bool:
    """Whether ``path`` has the form of a hub id (``name`` or ``org/name``, no ``./``, ``..`` or ``~``)."""
    return bool(_HUB_ID.match(path)) and ".." not in path and not path.startswith(".")
