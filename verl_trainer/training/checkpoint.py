"""Trainer checkpoints: one atomic directory per step, everything a run needs to continue exactly.

Layout of ``<dirpath>/step_000003/``::

    engines/<name>/          each engine's own checkpoint (model, optimizer, scheduler, RNG), written by
                             ``engine.save_checkpoint`` (DCP for FSDP, DeepSpeed's format for DeepSpeed)
    trainer_state.pt         global step, data position, module state, callback states (rank 0)
    rng_rank{r}.pt           each rank's RNG states (torch, CUDA, numpy, Python)
    meta.json                step, world size, strategy (for people and tools)

Everything except the engines' own files loads with ``torch.load(weights_only=True)``. The directory is
written as ``.step_000003.tmp`` and renamed into place only when every rank has finished
(``engine/checkpoint.py``'s :func:`~verl_trainer.engine.checkpoint.atomic_checkpoint_dir`), and
``trainer_state.pt`` is written last inside it, so a save interrupted at any point is never a candidate
for ``ckpt_path="last"`` (:func:`find_last_checkpoint`).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from verl_trainer.engine.checkpoint import atomic_checkpoint_dir, get_rng_state, set_rng_state

__all__ = [
    "STATE_FILE",
    "checkpoint_dir_name",
    "find_last_checkpoint",
    "list_checkpoints",
    "load_engines",
    "load_rng",
    "load_state",
    "prune_checkpoints",
    "write_checkpoint",
]

STATE_FILE = "trainer_state.pt"
RNG_FILE = "rng_rank{rank}.pt"
META_FILE = "meta.json"
ENGINES_DIR = "engines"
_STEP_RE = re.compile(r"^\.?step_(\d+)(\.old)?$")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


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


def find_last_checkpoint(dirpath: str | Path) -> Path | None:
    """The newest complete checkpoint under ``dirpath`` (see :func:`list_checkpoints`), or ``None``."""
    complete = list_checkpoints(dirpath)
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
    with atomic_checkpoint_dir(path) as tmp:
        for name, engine in engines.items():
            engine.save_checkpoint(str(tmp / ENGINES_DIR / name), global_step=global_step)
        torch.save({"rng": rng}, tmp / RNG_FILE.format(rank=_rank()))
        state = make_state()
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        if _rank() == 0:
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
            torch.save(state, tmp / STATE_FILE)  # last: its presence marks the directory complete


def load_state(path: Path) -> dict[str, Any]:
    """The trainer state of a checkpoint directory (``torch.load(weights_only=True)``)."""
    file = Path(path) / STATE_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a complete trainer checkpoint (no {STATE_FILE})")
    return torch.load(file, weights_only=True, map_location="cpu")


def load_engines(path: Path, engines: dict[str, Any]) -> None:
    """Restore every engine from ``path/engines/<name>``; a collective."""
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
    file = Path(path) / RNG_FILE.format(rank=_rank())
    if not file.is_file():
        return False
    set_rng_state(torch.load(file, weights_only=True, map_location="cpu")["rng"])
    return True


def prune_checkpoints(dirpath: str | Path, keep: int, current_step: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints, and stale temporary directories.

    Rank 0 only (the caller checks). Returns the deleted paths.
    """
    removed: list[Path] = []
    complete = list_checkpoints(dirpath)
    for _, path in complete[:-keep] if keep > 0 else complete:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    for entry in Path(dirpath).glob(".step_*.tmp"):
        match = re.match(r"^\.step_(\d+)\.tmp$", entry.name)
        if match and int(match.group(1)) <= current_step:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed
