"""Directories the project owns: the marker it writes into them, and the only ways it deletes or replaces.

Every directory verl-trainer writes as a whole (checkpoints, exported models, generated task data, the
warm-start policy) carries a marker file, :data:`OWNER_MARKER`, written before the directory gets its
final name. The project deletes or replaces a directory only through this module, and only when the
directory carries the marker (of the same kind as the one replacing it) or is empty; anything else fails
with :class:`NotOwnedError`, naming the path, so a mistyped ``export_dir=outputs`` can never erase a user's
files. When the project has finished writing a directory, the marker records its files
(:func:`record_files`); a file someone added later makes the directory irreplaceable too
(:func:`foreign_files`), so it is never deleted with it.

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

from verl_trainer.utils.disk_full import disk_full_error
from verl_trainer.utils.listing import first_of

__all__ = [
    "OWNER_MARKER",
    "NotOwnedError",
    "clean_stale",
    "discard_temporary",
    "ensure_replaceable",
    "foreign_files",
    "is_owned",
    "mark_owned",
    "read_marker",
    "record_files",
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
    previous = read_marker(path) or {}
    if "files" in previous and "files" not in details:
        details = {**details, "files": previous["files"]}  # re-marking keeps the record of what we wrote
    marker.write_text(json.dumps({"written_by": "verl-trainer", "kind": kind, **details}, sort_keys=True))
    return marker


def _walk(directory: Path) -> list[str]:
    """Files under ``directory`` (relative, sorted), leaving out our markers and directories of our own.

    A sub-directory carrying the marker (an HF export inside a checkpoint) records its own files.
    """
    found: list[str] = []
    for entry in sorted(directory.iterdir()):
        if entry.name == OWNER_MARKER:
            continue
        if entry.is_dir() and not entry.is_symlink():
            if not is_owned(entry):
                found += [f"{entry.name}/{rel}" for rel in _walk(entry)] or [f"{entry.name}/"]
        else:
            found.append(entry.name)
    return found


def record_files(directory: str | os.PathLike, also: tuple[str, ...] = ()) -> list[str]:
    """Record in ``directory``'s marker the files it holds now (call when the project finished writing it).

    :func:`ensure_replaceable` then refuses to replace or delete the directory while it holds any other
    file (one a user put there), so nothing of the user's is ever deleted with it.

    Args:
        directory: A directory carrying the marker.
        also: Files the project writes there afterwards (a checkpoint's ``manifest.json``).

    Returns:
        The recorded relative paths.
    """
    path = Path(directory)
    marker = read_marker(path)
    if marker is None:
        raise NotOwnedError(f"{str(path)!r} has no {OWNER_MARKER} marker to record its files in")
    files = sorted(set(_walk(path)) | set(also))
    extra = {k: v for k, v in marker.items() if k not in ("written_by", "kind")}
    mark_owned(path, str(marker.get("kind")), **{**extra, "files": files})
    return files


def _owned_below(directory: Path) -> list[Path]:
    """The directories carrying the marker below ``directory`` (not descending into them)."""
    found: list[Path] = []
    for entry in sorted(directory.iterdir()):
        if entry.is_dir() and not entry.is_symlink():
            found += [entry] if is_owned(entry) else _owned_below(entry)
    return found


def foreign_files(directory: str | os.PathLike) -> list[str]:
    """Files in a directory the project wrote that its marker does not record (``[]``: none recorded).

    Directories of its own below it (an engine checkpoint inside a trainer checkpoint) are checked against
    their own record.
    """
    root = Path(directory)
    recorded = (read_marker(root) or {}).get("files")
    found = [f for f in _walk(root) if f not in set(recorded)] if isinstance(recorded, list) else []
    for sub in _owned_below(root):
        found += [f"{sub.relative_to(root).as_posix()}/{f}" for f in foreign_files(sub)]
    return found


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


def _kinds(kind: str | tuple[str, ...] | None) -> tuple[str, ...] | None:
    return (kind,) if isinstance(kind, str) else kind


def ensure_replaceable(path: str | os.PathLike, what: str, kind: str | tuple[str, ...] | None = None) -> None:
    """Raise unless ``path`` is missing, an empty directory, or a directory the project wrote of ``kind``.

    Args:
        path: The directory about to be replaced or deleted.
        what: How the user named it (``"export_dir"``, ``"task.dir"``, ...), for the message.
        kind: The kind(s) of directory the caller writes there (``"hf_export"``, ...). A directory the
            project wrote as another kind (e.g. a checkpoint where an export is asked for) is refused:
            the project replaces a directory only with one of the same kind. ``None``: any of its own.

    Raises:
        NotOwnedError: Naming the path, what it is, and the fix.
    """
    target = Path(path)
    if not target.exists() and not target.is_symlink():
        return
    if target.is_dir() and not target.is_symlink() and _is_empty_dir(target):
        return
    marker = read_marker(target) if target.is_dir() and not target.is_symlink() else None
    kinds = _kinds(kind)
    if marker is not None and kinds is not None and marker.get("kind") not in kinds:
        raise NotOwnedError(
            f"{what}={str(target)!r} is a {marker.get('kind')!r} directory verl-trainer wrote, not a "
            f"{' or '.join(repr(k) for k in kinds)} one; refusing to replace it with another kind of "
            f"directory (a checkpoint is replaced only by a checkpoint save). Choose another directory for "
            f"{what}"
        )
    if marker is not None:
        foreign = foreign_files(target)
        if foreign:
            shown = first_of(foreign, 5)
            raise NotOwnedError(
                f"{what}={str(target)!r} was written by verl-trainer but now also holds files it did not "
                f"write ({shown}); refusing to replace or delete it, which would delete them. Move those "
                f"files out, or choose another directory for {what}"
            )
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


def remove_owned(path: str | os.PathLike, what: str = "directory", kind: str | tuple[str, ...] | None = None
                 ) -> None:
    """Delete a directory the project wrote (or an empty one); crash-safe (see the module).

    Args:
        path: The directory.
        what: How it is named in errors.
        kind: The kind(s) the caller means to delete (see :func:`ensure_replaceable`); ``None``: any.

    Raises:
        NotOwnedError: If ``path`` holds files and no marker, or a marker of another kind.
    """
    target = Path(path)
    if not target.exists():
        return
    ensure_replaceable(target, what, kind)
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
    out_dir: str | os.PathLike, write: Callable[[Path], Any], kind: str, what: str,
    replaces: tuple[str, ...] | None = None, **details: Any
) -> Path:
    """Write a directory under a temporary name, mark it, and move it to ``out_dir``.

    An existing ``out_dir`` is replaced only if the project wrote it (or it is empty); it is moved aside
    before the new one takes its name and deleted after, so ``out_dir`` is always complete or absent.

    Args:
        out_dir: The final directory.
        write: Writes the content into the directory it is given (exists, holds only the marker).
        kind: Recorded in the marker.
        what: How the user named ``out_dir`` (for errors).
        replaces: The kinds of the project's directories it may replace (default: ``(kind,)``).
        **details: Recorded in the marker.

    Returns:
        ``out_dir`` as a path.

    Raises:
        NotOwnedError: If ``out_dir`` holds files the project did not write, or is a directory of another
            kind (checked before writing).
    """
    final = Path(out_dir)
    ensure_replaceable(final, what, replaces or kind)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(final, TMP_TAG + "-")
    mark_owned(tmp, kind, **details)  # first, so a killed write is recognised and cleaned later
    try:
        write(tmp)
        record_files(tmp)
        if final.exists():
            trash = _sibling(final, TRASH_TAG)
            final.rename(trash)
            tmp.rename(final)
            _delete_marker_last(trash)
        else:
            tmp.rename(final)
    except BaseException as exc:
        full = disk_full_error(exc, final, what)  # before the half-written files are removed
        if tmp.exists():
            _delete_marker_last(tmp)
        if full is not None and full is not exc:
            raise full from exc
        raise
    return final
