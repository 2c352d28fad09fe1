"""Trainer checkpoints: one atomic directory per step, everything a run needs to continue exactly.

Layout of ``<dirpath>/step_000003/``::

    engines/<name>/          each engine's own checkpoint (model, optimizer, scheduler, RNG), written by
                             ``engine.save_checkpoint`` (DCP for FSDP, DeepSpeed's format for DeepSpeed)
    trainer_state.pt         global step, data position, module state, callback states (rank 0)
    rng_rank{r}.pt           each rank's RNG states (torch, CUDA, numpy, Python)
    meta.json                step, world size, strategy, run id (for people and tools)
    manifest.json            size and sha256 of every file (engines: their own manifest's), verified
                             before anything is loaded (``verl_trainer.utils.manifest``)

Everything loads pickle-free (``verl_trainer.utils.safe_load``; the engines' DCP files through
``engine/safe_dcp.py``). Each checkpoint records its run id; pruning deletes only the current run's
checkpoints and only directories carrying the project's marker (``verl_trainer.utils.fs``). The directory is
written as ``.step_000003.tmp`` and renamed into place only when every rank has finished
(``engine/checkpoint.py``'s :func:`~verl_trainer.engine.checkpoint.atomic_checkpoint_dir`), and
``trainer_state.pt`` is written last inside it, so a save interrupted at any point is never a candidate
for ``ckpt_path="last"`` (:func:`find_last_checkpoint`).
"""

from __future__ import annotations

import json
import re
import uuid
import warnings
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from verl_trainer.engine.checkpoint import (
    CHECKPOINT_KIND,
    atomic_checkpoint_dir,
    get_rng_state,
    set_rng_state,
)
from verl_trainer.utils.distributed import barrier, get_rank
from verl_trainer.utils.fs import (
    OWNER_MARKER,
    NotOwnedError,
    clean_stale,
    is_owned,
    read_marker,
    remove_owned,
)
from verl_trainer.utils.manifest import verify_manifest
from verl_trainer.utils.safe_load import safe_torch_load

__all__ = [
    "STATE_FILE",
    "checkpoint_dir_name",
    "claim_checkpoint_dir",
    "checkpoint_run_id",
    "describe_runs",
    "find_last_checkpoint",
    "list_checkpoints",
    "load_engines",
    "load_rng",
    "load_state",
    "prune_checkpoints",
    "runs_in",
    "write_checkpoint",
]

STATE_FILE = "trainer_state.pt"
RNG_FILE = "rng_rank{rank}.pt"
META_FILE = "meta.json"
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


def write_checkpoint(
    path: Path,
    engines: dict[str, Any],
    make_state: Callable[[], dict[str, Any]],
    meta: dict[str, Any],
    global_step: int,
) -> None:
    """Write one checkpoint atomically; a collective (every rank calls it).

    Order inside the temporary directory: the engines, every rank's RNG, then (rank 0) ``meta.json``
    and ``trainer_state.pt``. ``make_state`` is called on every rank after the engines are written (it
    dispatches ``on_save_checkpoint``), so a crash anywhere in it leaves no committed directory.

    Args:
        path: The final directory (``<dirpath>/step_000003``).
        engines: The module's engines by name; each saves into ``engines/<name>``.
        make_state: Returns the trainer state (plain data and tensors); rank 0's is written.
        meta: Plain metadata for ``meta.json``.
        global_step: The step being saved.
    """
    rng = get_rng_state()  # before anything else runs, so it is the state the next step starts from
    with atomic_checkpoint_dir(path, run_id=meta.get("run_id"), step=int(global_step)) as tmp:
        for name, engine in engines.items():
            engine.save_checkpoint(str(tmp / ENGINES_DIR / name), global_step=global_step)
        torch.save({"rng": rng}, tmp / RNG_FILE.format(rank=get_rank()))
        state = make_state()
        barrier()
        if get_rank() == 0:
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
            torch.save(state, tmp / STATE_FILE)  # last: its presence marks the directory complete


def load_state(path: Path) -> dict[str, Any]:
    """The trainer state of a checkpoint directory (``torch.load(weights_only=True)``)."""
    file = Path(path) / STATE_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a complete trainer checkpoint (no {STATE_FILE})")
    return safe_torch_load(file)


def load_engines(path: Path, engines: dict[str, Any]) -> None:
    """Verify ``path``'s manifest, then restore every engine from ``path/engines/<name>``; a collective.

    Raises:
        CorruptCheckpointError: If a file of the checkpoint is missing, truncated or corrupted (each
            engine verifies its own files when it loads).
        FileNotFoundError: If an engine has no state in the checkpoint.
    """
    verify_manifest(path, recurse=False)
    for name, engine in engines.items():
        sub = Path(path) / ENGINES_DIR / name
        if not sub.exists():
            raise FileNotFoundError(
                f"checkpoint {str(path)!r} has no state for engine {name!r} (found: "
                f"{sorted(p.name for p in (Path(path) / ENGINES_DIR).glob('*'))})"
            )
        engine.load_checkpoint(str(sub))


def load_rng(path: Path) -> bool:
    """Restore this rank's RNG states; ``False`` when the checkpoint has none for this rank."""
    file = Path(path) / RNG_FILE.format(rank=get_rank())
    if not file.is_file():
        return False
    set_rng_state(safe_torch_load(file)["rng"])
    return True


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
