"""Directories the project owns: the marker it writes into them, and the only ways it deletes or replaces.

Every directory verl-trainer writes as a whole (checkpoints, exported models, generated task data, the
warm-start policy) carries a marker file, :data:`OWNER_MARKER`, written before the directory gets its
final name. The project deletes or replaces a directory only through this module, and only when the
directory carries the marker or is empty; anything else fails with :class:`NotOwnedError`, naming the
path, so a mistyped ``export_dir=outputs`` can never erase a user's files.

Deletion is crash-safe: :func:`remove_owned` first renames the directory to a hidden ``.<name>.trash-*``
sibling (so a half-deleted directory never looks like a complete one) and removes the marker last (so a
half-deleted directory is still recognised as the project's and :func:`clean_stale` finishes the job).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "OWNER_MARKER",
    "NotOwnedError",
    "clean_stale",
    "discard_temporary",
    "ensure_replaceable",
    "is_owned",
    "mark_owned",
    "read_marker",
    "remove_owned",
    "replace_dir_atomically",
]

OWNER_MARKER = ".verl_trainer_output"
"""File name of the marker inside every directory the project wrote (JSON: ``kind`` and details)."""
TRASH_TAG = ".trash-"
TMP_TAG = ".tmp"


class NotOwnedError(FileExistsError):
    """A path the project was asked to replace or delete holds files the project did not write."""


def mark_owned(directory: str | os.PathLike, kind: str, **details: Any) -> Path:
    """Write the marker into ``directory`` (created if missing); returns the marker's path.

    Args:
        directory: The directory being written.
        kind: What it is (``"checkpoint"``, ``"hf_export"``, ``"task"``, ...).
        **details: Further plain data to record (e.g. ``run_id``).
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    marker = path / OWNER_MARKER
    marker.write_text(json.dumps({"written_by": "verl-trainer", "kind": kind, **details}, sort_keys=True))
    return marker


def read_marker(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The marker's content, or ``None`` when ``directory`` has no (readable) marker."""
    try:
        data = json.loads((Path(directory) / OWNER_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("written_by") == "verl-trainer" else None


def is_owned(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` carries the project's marker."""
    return read_marker(directory) is not None


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def ensure_replaceable(path: str | os.PathLike, what: str) -> None:
    """Raise unless ``path`` is missing, an empty directory, or a directory the project wrote.

    Args:
        path: The directory about to be replaced or deleted.
        what: How the user named it (``"export_dir"``, ``"task.dir"``, ...), for the message.

    Raises:
        NotOwnedError: Naming the path and the fix.
    """
    target = Path(path)
    if not target.exists() and not target.is_symlink():
        return
    if target.is_dir() and not target.is_symlink() and (_is_empty_dir(target) or is_owned(target)):
        return
    kind = "a file" if not target.is_dir() else "a non-empty directory"
    raise NotOwnedError(
        f"{what}={str(target)!r} is {kind} that verl-trainer did not write (it has no {OWNER_MARKER} "
        f"marker); refusing to replace or delete it. Choose a new or empty directory for {what}, or move "
        f"or delete {str(target)!r} yourself"
    )


def _sibling(path: Path, tag: str) -> Path:
    return path.parent / f".{path.name}{tag}{uuid.uuid4().hex[:8]}"


def _delete_marker_last(path: Path) -> None:
    for entry in path.iterdir():
        if entry.name == OWNER_MARKER:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    (path / OWNER_MARKER).unlink(missing_ok=True)
    path.rmdir()


def remove_owned(path: str | os.PathLike, what: str = "directory") -> None:
    """Delete a directory the project wrote (or an empty one); crash-safe (see the module).

    Raises:
        NotOwnedError: If ``path`` holds files and no marker.
    """
    target = Path(path)
    if not target.exists():
        return
    ensure_replaceable(target, what)
    if TRASH_TAG not in target.name:
        trash = _sibling(target, TRASH_TAG)
        target.rename(trash)
        target = trash
    _delete_marker_last(target)


def discard_temporary(path: str | os.PathLike) -> None:
    """Delete a directory at a temporary name the caller derived itself (``.<name>.tmp``), if present.

    For a save's own scratch directory only (a stale one from an interrupted save of the same target, or
    the one a failed save leaves); never call it with a path the user named. Errors are ignored: what
    remains is hidden, never taken for a checkpoint, and removed by the next save or :func:`clean_stale`.
    """
    target = Path(path)
    if TMP_TAG not in target.name or not target.name.startswith("."):
        raise ValueError(f"discard_temporary is for hidden '.<name>{TMP_TAG}' directories, got "
                         f"{str(target)!r}")
    shutil.rmtree(target, ignore_errors=True)


def clean_stale(root: str | os.PathLike, patterns: tuple[str, ...] = (f".*{TMP_TAG}*", f".*{TRASH_TAG}*")
                ) -> list[Path]:
    """Remove the half-written and half-deleted directories an interrupted save or deletion left.

    Half-written: ``.<name>.tmp*``; half-deleted: ``.<name>.trash-*``, directly under ``root``. Only
    directories carrying the marker, or empty ones, are removed; others are left alone.

    Returns:
        The removed paths.
    """
    removed: list[Path] = []
    base = Path(root)
    if not base.is_dir():
        return removed
    for pattern in patterns:
        for entry in sorted(base.glob(pattern)):
            if entry.is_dir() and not entry.is_symlink() and (is_owned(entry) or _is_empty_dir(entry)):
                _delete_marker_last(entry)
                removed.append(entry)
    return removed


def replace_dir_atomically(
    out_dir: str | os.PathLike, write: Callable[[Path], Any], kind: str, what: str, **details: Any
) -> Path:
    """Write a directory under a temporary name, mark it, and move it to ``out_dir``.

    An existing ``out_dir`` is replaced only if the project wrote it (or it is empty); it is moved aside
    before the new one takes its name and deleted after, so ``out_dir`` is always complete or absent.

    Args:
        out_dir: The final directory.
        write: Writes the content into the directory it is given (exists, holds only the marker).
        kind: Recorded in the marker.
        what: How the user named ``out_dir`` (for errors).
        **details: Recorded in the marker.

    Returns:
        ``out_dir`` as a path.

    Raises:
        NotOwnedError: If ``out_dir`` holds files the project did not write (checked before writing).
    """
    final = Path(out_dir)
    ensure_replaceable(final, what)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(final, TMP_TAG + "-")
    mark_owned(tmp, kind, **details)  # first, so a killed write is recognised and cleaned later
    try:
        write(tmp)
        if final.exists():
            trash = _sibling(final, TRASH_TAG)
            final.rename(trash)
            tmp.rename(final)
            _delete_marker_last(trash)
        else:
            tmp.rename(final)
    except BaseException:
        if tmp.exists():
            _delete_marker_last(tmp)
        raise
    return final
