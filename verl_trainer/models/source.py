"""Where a model comes from: a local HF directory, or a hub id already in the local HF cache. Never invented.

:func:`resolve_model_path` turns what a user wrote (``model.path``, ``algorithm.model_path``) into a local
directory that ``from_pretrained`` reads without any network access:

* a directory with ``config.json`` is used as is;
* a hub id (``Qwen/Qwen2.5-0.5B-Instruct``) resolves through transformers' normal cache lookup
  (``huggingface_hub.try_to_load_from_cache``: ``<HF_HOME>/hub/models--Qwen--Qwen2.5-0.5B-Instruct/
  snapshots/<revision of refs/main>/``) when the model was downloaded before; nothing is downloaded here;
* anything else is a :class:`ModelNotFoundError` naming the path, saying whether it looked like a hub id and
  where the cache was searched, and how to fix it. The check is a file-system lookup, so every rank of a
  run reaches the same verdict before any model is loaded.
"""

from __future__ import annotations

import os
from pathlib import Path

from verl_trainer.utils.hub_cache import hub_cache_dir, looks_like_hub_id

__all__ = ["ModelNotFoundError", "resolve_model_path"]

class ModelNotFoundError(FileNotFoundError):
    """A model path is neither a local HF directory nor a model in the local HF cache."""


def _cached_snapshot(repo_id: str) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json", cache_dir=str(hub_cache_dir()))
    return Path(found).parent if isinstance(found, str) else None


def resolve_model_path(path: str | os.PathLike, what: str = "model_path") -> str:
    """The local directory of the model ``path`` names (see the module); no download is ever tried.

    Args:
        path: A local HF directory or a hub id.
        what: How the user named the setting (``"model.path"``), for the message.

    Returns:
        ``path`` itself for a local directory, else the cached snapshot directory.

    Raises:
        ModelNotFoundError: If it is neither (the message names the path, whether it looked like a hub id,
            and the fix).
    """
    text = str(path)
    local = Path(text).expanduser()
    if (local / "config.json").is_file():
        return text
    if local.is_dir():
        raise ModelNotFoundError(
            f"{what}={text!r} is a directory but has no config.json, so it is not a HF model directory; "
            f"point {what} to the directory that save_pretrained wrote (config.json + *.safetensors)"
        )
    if text and looks_like_hub_id(text):
        snapshot = _cached_snapshot(text)
        if snapshot is not None:
            return str(snapshot)
        raise ModelNotFoundError(
            f"{what}={text!r} is not a local directory, and it looks like a hub id but is not in the local "
            f"HF cache ({hub_cache_dir()}; set HF_HOME or HF_HUB_CACHE if your cache is elsewhere). "
            f"verl-trainer never downloads models and never makes one up: download it first "
            f"(`hf download {text}`, or `huggingface-cli download {text}`), or set {what} to a local "
            f"model directory"
        )
    raise ModelNotFoundError(
        f"{what}={text!r} does not exist (it is not a local directory, and it does not look like a hub id "
        f"such as 'org/name'). Set {what} to a local HF model directory (config.json + *.safetensors), or to "
        f"a hub id you have downloaded into the HF cache"
    )
