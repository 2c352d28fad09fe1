"""The run's checkpoint directory: one ``step_000003/`` per saved step, named, listed, claimed and pruned.

Layout of ``<dirpath>/step_000003/`` (written by ``training/checkpoint.py``)::

    engines/<name>/          each engine's own checkpoint (model, optimizer, scheduler, RNG), written by
                             ``engine.save_checkpoint`` (DCP for FSDP, DeepSpeed's format for DeepSpeed)
    trainer_state.pt         global step, data position, module state, callback states (rank 0)
    rng_rank{r}.pt           each rank's RNG states (torch, CUDA, numpy, Python)
    meta.json                step, world size, strategy, run id (for people and tools)
    manifest.json            size and sha256 of every file (engines: their own manifest's), verified
                             before anything is loaded (``verl_trainer.utils.manifest``)

A step directory is complete once ``trainer_state.pt`` is in it (written last, inside the atomic
directory of :func:`~verl_trainer.engine.checkpoint.atomic_checkpoint_dir`), so a save interrupted at any
point is never a candidate for ``ckpt_path="last"`` (:func:`find_last_checkpoint`). Each checkpoint
records its run id; a run claims the directory (:func:`claim_checkpoint_dir`) and pruning deletes only its
own checkpoints, and only directories carrying the project's marker (``verl_trainer.utils.fs``). Read by
the Trainer's loops, ``ModelCheckpoint``, ``RayTrainReport`` and the checkpoint converter.
"""

from __future__ import annotations

import json
import re
import uuid
import warnings
from collections.abc import Collection
from pathlib import Path

from verl_trainer.engine.checkpoint import CHECKPOINT_KIND, META_FILE
from verl_trainer.utils.fs import (
    OWNER_MARKER,
    NotOwnedError,
    clean_stale,
    is_owned,
    read_marker,
    remove_owned,
)

__all__ = [
    "ENGINES_DIR",
    "META_FILE",
    "RNG_FILE",
    "STATE_FILE",
    "checkpoint_dir_name",
    "checkpoint_run_id",
    "claim_checkpoint_dir",
    "describe_runs",
    "find_last_checkpoint",
    "list_checkpoints",
    "prune_checkpoints",
    "runs_in",
]

STATE_FILE = "trainer_state.pt"
RNG_FILE = "rng_rank{rank}.pt"
ENGINES_DIR = "engines"
_STEP_RE = re.compile(r"^\.?step_(\d+)(\.old)?$")


def checkpoint_dir_name(step: int) -> str:
    """``step_000003`` for step 3."""
    return f"step_{step:06d}"


def list_checkpoints(dirpath: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``dirpath`` as ``(step, path)``, oldest first.

    Complete means committed (not a ``.tmp`` directory) and holding ``trainer_state.pt``. A checkpoint
    moved aside as ``.step_N.old`` by a save of the same step that was interrupted while committing
    counts when ``step_N`` itself is missing.
    """
    root = Path(dirpath)
    if not root.is_dir():
        return []
    found: dict[int, Path] = {}
    for entry in root.iterdir():
        match = _STEP_RE.match(entry.name)
        if match is None or not entry.is_dir() or not (entry / STATE_FILE).is_file():
            continue
        if entry.name.startswith(".") != bool(match.group(2)):  # ".step_N" or "step_N.old": not ours
            continue
        step = int(match.group(1))
        if step not in found or not entry.name.startswith("."):
            found[step] = entry
    return sorted(found.items())


def checkpoint_run_id(path: str | Path) -> str | None:
    """The run id a checkpoint records in ``meta.json`` (``None``: none recorded or unreadable)."""
    try:
        run_id = json.loads((Path(path) / META_FILE).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return str(run_id) if run_id is not None else None


def runs_in(dirpath: str | Path) -> dict[str | None, list[int]]:
    """``{run id: [steps]}`` of the complete checkpoints under ``dirpath``."""
    runs: dict[str | None, list[int]] = {}
    for step, path in list_checkpoints(dirpath):
        runs.setdefault(checkpoint_run_id(path), []).append(step)
    return runs


def describe_runs(runs: dict[str | None, list[int]]) -> str:
    """``run 1a2b (steps 2, 3); run <unrecorded> (step 5)`` for messages."""
    parts = []
    for run_id, steps in runs.items():
        label = run_id if run_id is not None else "<not recorded>"
        parts.append(f"run {label} (step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))})")
    return "; ".join(parts)


def find_last_checkpoint(dirpath: str | Path) -> Path | None:
    """The newest complete checkpoint under ``dirpath`` (see :func:`list_checkpoints`), or ``None``.

    Raises:
        ValueError: If ``dirpath`` holds checkpoints of more than one run ("last" would be ambiguous).
    """
    complete = list_checkpoints(dirpath)
    runs = runs_in(dirpath)
    if len(runs) > 1:
        raise ValueError(
            f"ckpt_path='last' is ambiguous: {str(dirpath)!r} holds checkpoints of several runs "
            f"({describe_runs(runs)}); pass the checkpoint directory to resume as ckpt_path=<dir>"
        )
    return complete[-1][1] if complete else None


def prune_checkpoints(dirpath: str | Path, keep: int, current_step: int, run_id: str | None = None,
                      protect: Collection[int] = ()) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints of run ``run_id``, and its stale temporaries.

    The checkpoints of the steps in ``protect`` are kept too (``ModelCheckpoint(monitor=)``: the best ones).

    Checkpoints of other runs are never touched. Rank 0 only (the caller checks). Deletion goes through
    :func:`~verl_trainer.utils.fs.remove_owned`: only directories carrying the project's marker,
    renamed aside before they are deleted, so a deletion interrupted half-way never leaves something
    that looks like a checkpoint. Returns the deleted paths.
    """
    removed: list[Path] = []
    ours = [(step, path) for step, path in list_checkpoints(dirpath) if checkpoint_run_id(path) == run_id]
    for step, path in ours[:-keep] if keep > 0 else ours:
        if step in protect:
            continue
        if not is_owned(path):
            warnings.warn(f"not pruning {str(path)!r}: it has no {OWNER_MARKER} marker, so verl-trainer "
                          f"did not write it", stacklevel=2)
            continue
        try:
            remove_owned(path, "checkpoint", CHECKPOINT_KIND)
        except NotOwnedError as exc:  # e.g. a user's file inside it: kept, the run goes on
            warnings.warn(f"not pruning: {exc}", stacklevel=2)
            continue
        removed.append(path)
    for entry in Path(dirpath).glob(".step_*.tmp*"):
        match = re.match(r"^\.step_(\d+)\.tmp(-\w+)?$", entry.name)
        marker = read_marker(entry) or {}
        if match and int(match.group(1)) <= current_step and marker.get("run_id") == run_id:
            remove_owned(entry, "checkpoint", CHECKPOINT_KIND)
            removed.append(entry)
    return removed


def claim_checkpoint_dir(dirpath: str | Path, run_id: str | None, resumed: bool = False,
                         new_id: str | None = None) -> tuple[str | None, list[Path]]:
    """Prepare ``dirpath`` for run ``run_id``; rank 0 only.

    ``resumed=False``: a fresh run (every checkpoint in ``dirpath`` is another run's; it gets ``new_id``,
    or a new random id when that is ``None``).
    ``resumed=True``: a run restored from a checkpoint recording ``run_id`` (``None`` for one written
    before run ids existed: it keeps ``None`` and owns the checkpoints without an id).

    Removes the half-written (``.step_N.tmp``) and half-deleted (``.step_N.trash-*``) folders an
    interrupted save or pruning left (the project's own only), then checks that every complete checkpoint
    in ``dirpath`` belongs to this run.

    Returns:
        The run id (a new one for a fresh run) and the removed folders.

    Raises:
        FileExistsError: If ``dirpath`` holds checkpoints of another run, naming them and the fix.
    """
    cleaned = clean_stale(dirpath, (".step_*.tmp*", ".step_*.trash-*"))
    others = {rid: steps for rid, steps in runs_in(dirpath).items() if not resumed or rid != run_id}
    if others:
        action = f"run {run_id}" if resumed else "a new run"
        raise FileExistsError(
            f"checkpoint directory {str(dirpath)!r} holds checkpoints of another run "
            f"({describe_runs(others)}); {action} would mix its checkpoints with them. Resume that run with "
            f"ckpt_path='last' (recipes: trainer.ckpt_path=last), or give this run another directory "
            f"(default_root_dir, or ModelCheckpoint(dirpath=...))"
        )
    return run_id if resumed else (new_id or uuid.uuid4().hex[:12]), cleaned
