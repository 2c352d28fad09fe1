"""Integrity manifests of checkpoint directories: every file's size and sha256, verified on resume.

:func:`write_manifest` is the last step of a checkpoint save, before the directory is renamed into place;
:func:`verify_manifest` runs before anything is loaded and refuses a checkpoint with a missing, truncated
or corrupted file, naming it. Both are collectives when a process group is initialized: each rank hashes
a share of the files, so the cost is spread, and every rank raises the same error together.

A sub-directory holding its own ``manifest.json`` (an engine's checkpoint inside a trainer checkpoint) is
covered by that file: the outer manifest records the inner ``manifest.json``'s hash and does not hash the
inner files again; ``verify_manifest(..., recurse=True)`` checks the inner ones too.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from verl_trainer.utils.distributed import all_gather_object, get_rank, get_world_size
from verl_trainer.utils.listing import first_of

__all__ = ["MANIFEST_FILE", "CorruptCheckpointError", "file_digest", "verify_manifest", "write_manifest"]

MANIFEST_FILE = "manifest.json"
_CHUNK = 1 << 20


class CorruptCheckpointError(RuntimeError):
    """A checkpoint's files do not match its manifest (or it has none)."""


def _listing(directory: Path) -> tuple[list[str], list[str]]:
    """Files to hash (relative, sorted) and sub-directories covered by their own manifest."""
    files: list[str] = []
    nested: list[str] = []

    def walk(sub: Path) -> None:
        for entry in sorted(sub.iterdir()):
            if entry.is_dir() and not entry.is_symlink():
                if (entry / MANIFEST_FILE).is_file():
                    nested.append(entry.relative_to(directory).as_posix())
                    files.append((entry / MANIFEST_FILE).relative_to(directory).as_posix())
                else:
                    walk(entry)
            elif entry != directory / MANIFEST_FILE:
                files.append(entry.relative_to(directory).as_posix())

    walk(directory)
    return files, nested


def file_digest(path: str | os.PathLike) -> tuple[int, str]:
    """``(size, sha256 hex)`` of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def write_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """Hash every file under ``directory`` and (rank 0) write ``manifest.json``; a collective.

    Returns:
        The manifest (``files``: ``{relative path: {"size", "sha256"}}``, ``nested``: sub-directories
        with their own manifest).
    """
    root = Path(directory)
    rank, world = get_rank(), get_world_size()
    files, nested = _listing(root)
    share = {name: file_digest(root / name) for name in files[rank::world]}
    merged: dict[str, tuple[int, str]] = {}
    for part in all_gather_object(share):
        merged.update(part)
    manifest = {
        "version": 1,
        "files": {name: {"size": merged[name][0], "sha256": merged[name][1]} for name in files},
        "nested": nested,
    }
    if rank == 0:
        tmp = root / f".{MANIFEST_FILE}.tmp"
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        os.replace(tmp, root / MANIFEST_FILE)
    return manifest


def _problems(root: Path, recorded: dict[str, Any], names: list[str]) -> list[str]:
    found = []
    for name in names:
        path, want = root / name, recorded[name]
        if not path.is_file():
            found.append(f"{path}: missing")
            continue
        size = path.stat().st_size
        if size != want["size"]:
            found.append(f"{path}: {size} bytes, the manifest records {want['size']} (truncated or replaced)")
        elif file_digest(path)[1] != want["sha256"]:
            found.append(f"{path}: sha256 differs from the manifest (corrupted or modified)")
    return found


def _read(root: Path) -> dict[str, Any]:
    path = root / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError("files is not a mapping")
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"checkpoint {str(root)!r} has no {MANIFEST_FILE}, so its files cannot be verified: it is "
            f"incomplete, or was written by an older verl-trainer. Resume from another checkpoint, or, if "
            f"you trust it, adopt it with verl_trainer.utils.manifest.write_manifest({str(root)!r})"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(
            f"{str(path)!r} is unreadable ({type(exc).__name__}: {exc}); the checkpoint cannot be verified. "
            f"Resume from another checkpoint"
        ) from None
    return manifest


def verify_manifest(directory: str | os.PathLike, recurse: bool = True) -> None:
    """Check every file of ``directory`` against its manifest; a collective (each rank checks a share).

    Args:
        directory: The checkpoint directory.
        recurse: Also verify sub-directories with their own manifest (else only their manifest file).

    Raises:
        CorruptCheckpointError: On every rank, naming each missing, truncated or corrupted file.
    """
    rank, world = get_rank(), get_world_size()
    pending, problems = [Path(directory)], []
    while pending:
        root = pending.pop(0)
        error = None
        try:
            manifest = _read(root)
        except CorruptCheckpointError as exc:
            error = str(exc)
        errors = [e for e in all_gather_object(error) if e]
        if errors:
            raise CorruptCheckpointError(errors[0])
        names = sorted(manifest["files"])
        found = _problems(root, manifest["files"], names[rank::world])
        problems.extend(p for part in all_gather_object(found) for p in part)
        if recurse:
            pending.extend(root / sub for sub in manifest.get("nested", []))
    if problems:
        listed = first_of(problems, 8, "; ")
        raise CorruptCheckpointError(
            f"checkpoint {str(directory)!r} failed its integrity check: {listed}. Refusing to resume from "
            f"it: resume from another checkpoint (ckpt_path=<an earlier step_* directory>), or restore it "
            f"from a copy"
        )
