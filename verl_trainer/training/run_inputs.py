"""What a run reads besides its config — the LoRA base weights and the data files — fingerprinted by content.

A checkpoint's ``meta.json`` records (``resume_check.run_metadata``):

* ``base_weights``: for every engine with LoRA adapters, its ``model_path`` and the fingerprint of each
  weights file there (:func:`base_weights_fingerprint`). The adapters are deltas on those exact weights, so
  a resume on changed base weights (a re-downloaded or re-trained model at the same path) is refused,
  naming the engine, the path and the files (:func:`check_base_weights`);
* ``data``: the datamodule's :meth:`fingerprint` when it has one (the recipes' datamodules: the path and
  content of ``data.train_files`` / ``data.val_files``). The data position a checkpoint continues from is a
  place in *that* data's order, so a resume on other training data is refused; other validation data is
  listed and applies (:func:`check_data`).

Fingerprints are :func:`~verl_trainer.utils.cached_dir.fingerprint`: the sha256 of files up to 64 MiB,
size and modification time of larger ones (so a copied multi-GB base model reads as changed: resume on
the original, or start a new run).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from verl_trainer.models.source import ModelNotFoundError, resolve_model_path
from verl_trainer.utils.cached_dir import fingerprint

if TYPE_CHECKING:
    from verl_trainer.engine.base import BaseEngine

__all__ = ["WEIGHT_PATTERNS", "base_weights_fingerprint", "check_base_weights", "check_data",
           "data_fingerprint"]

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth")
"""The files of a model directory that hold its weights."""


def base_weights_fingerprint(engine: BaseEngine) -> dict[str, Any] | None:
    """``{"model_path", "files": {name: key}}`` of a LoRA engine's base model; ``None`` without LoRA."""
    path = getattr(getattr(engine, "config", None), "model_path", None)
    if not getattr(engine, "has_adapters", False) or not path:
        return None

    try:
        local = Path(resolve_model_path(path))
    except ModelNotFoundError:
        return {"model_path": str(path), "files": {}}
    files = sorted({f for pattern in WEIGHT_PATTERNS for f in local.glob(pattern) if f.is_file()})
    return {"model_path": str(path), "files": {f.name: fingerprint(f) for f in files}}


def data_fingerprint(datamodule: Any) -> dict[str, Any] | None:
    """The datamodule's own ``fingerprint()`` (plain JSON data), or ``None`` when it has none."""
    method = getattr(datamodule, "fingerprint", None)
    return method() if callable(method) else None


def _short(key: Any) -> str:
    text = str(key)
    return text[:19] + "…" if text.startswith("sha256:") else text


def _file_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    changes = []
    for name in sorted(set(saved) | set(now)):
        if saved.get(name) != now.get(name):
            before = _short(saved[name]) if name in saved else "absent"
            after = _short(now[name]) if name in now else "absent"
            changes.append(f"{name}: {before} -> {after}")
    return changes


def check_base_weights(path: Path, saved: dict[str, Any], engines: dict[str, BaseEngine]) -> str | None:
    """Why a resume cannot continue on these LoRA engines' base weights (``None``: the checkpoint's).

    Args:
        path: The checkpoint (for messages).
        saved: ``meta["base_weights"]``: ``{engine name: base_weights_fingerprint}``.
        engines: The built engines.

    Returns:
        The refusal (``resume_check`` raises it as ``ResumeMismatchError``), naming the engine, its
        ``model_path`` and the changed files; ``None`` when nothing changed.
    """
    for name, old in saved.items():
        if name not in engines or not isinstance(old, dict):
            continue
        new = base_weights_fingerprint(engines[name]) or {"model_path": None, "files": {}}
        changes = _file_changes(old.get("files") or {}, new.get("files") or {})
        if changes:
            return (
                f"cannot resume from {str(path)!r}: the base weights of LoRA engine {name!r} changed since "
                f"the checkpoint (model_path {old.get('model_path')!r} then, {new.get('model_path')!r} now; "
                f"{'; '.join(changes[:4])}); its adapters were trained on the old weights. Put the original "
                f"base model back at model_path, or start a new run"
            )
    return None


def check_data(path: Path, saved: dict[str, Any], now: dict[str, Any] | None) -> tuple[list[str], str | None]:
    """Compare the checkpoint's data with this run's: other training data is refused, the rest listed.

    Args:
        path: The checkpoint (for messages).
        saved: ``meta["data"]``: ``{key: {"path", "content"}}`` (``train_files``, ``val_files``, ...).
        now: This run's :func:`data_fingerprint` (``None``: the datamodule records none; nothing compared).

    Returns:
        The differences that apply (one line each), and the refusal when ``train_files`` differs in content
        (naming both paths; ``resume_check`` raises it as ``ResumeMismatchError``), else ``None``.
    """
    if now is None:
        return [], None
    changes = []
    for key in sorted(set(saved) | set(now)):
        old, new = saved.get(key) or {}, now.get(key) or {}
        if old.get("content") == new.get("content"):
            if old.get("path") != new.get("path"):
                changes.append(f"data.{key}: {old.get('path')!r} -> {new.get('path')!r} (the same content)")
            continue
        if key == "train_files":
            return changes, (
                f"cannot resume from {str(path)!r}: the training data changed since the checkpoint "
                f"(data.train_files={old.get('path')!r} then, {new.get('path')!r} now, with other content); "
                f"the checkpoint continues at a position in the old data's order, which means nothing in "
                f"other data. Resume with the checkpoint's data, or start a new run from its exported weights"
            )
        changes.append(f"data.{key}: {old.get('path')!r} -> {new.get('path')!r} (other content)")
    return changes, None
