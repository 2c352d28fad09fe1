"""Trainer checkpoints: write and restore one step's directory, everything a run needs to continue exactly.

:func:`save_run` writes the engines, every rank's RNG, ``meta.json`` and ``trainer_state.pt`` (the
:class:`~verl_trainer.training.progress.Progress` — step and loader position — the module's and the
callbacks' states); :func:`check_resume` finds the checkpoint a resume asks for and checks the run against
it before any engine is built; :func:`restore_run` loads it back.

The directory's layout, its name, and which directories count as complete and whose run they are live in
:mod:`verl_trainer.engine.checkpoint_dirs` (read by callbacks and the converter too). Everything loads
pickle-free (``verl_trainer.utils.safe_load``; the engines' DCP files through ``engine/safe_dcp.py``). The
directory is written as ``.step_000003.tmp`` and renamed into place only when every rank has finished
(:func:`~verl_trainer.engine.checkpoint.atomic_checkpoint_dir`), and ``trainer_state.pt`` is written last
inside it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from verl_trainer.callbacks.base import Callback
from verl_trainer.engine.checkpoint import atomic_checkpoint_dir, get_rng_state, set_rng_state
from verl_trainer.engine.checkpoint_dirs import (
    ENGINES_DIR,
    META_FILE,
    RNG_FILE,
    STATE_FILE,
    find_last_checkpoint,
)
from verl_trainer.module import TrainingModule
from verl_trainer.training import resume_check
from verl_trainer.training.progress import Progress
from verl_trainer.training.resume_check import ResumingRun
from verl_trainer.utils.distributed import barrier, broadcast_object, get_rank
from verl_trainer.utils.manifest import verify_manifest
from verl_trainer.utils.safe_load import safe_torch_load

if TYPE_CHECKING:
    from verl_trainer.engine.base import BaseEngine

__all__ = [
    "check_resume", "load_engines", "load_rng", "load_state", "restore_run", "save_run", "write_checkpoint",
]

STATE_VERSION = 1
"""The version of ``trainer_state.pt``'s layout."""


def write_checkpoint(
    path: Path,
    engines: dict[str, BaseEngine],
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


def load_engines(path: Path, engines: dict[str, BaseEngine]) -> None:
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


def save_run(path: Path, progress: Progress, module: TrainingModule, callbacks: Sequence[Callback],
             call_hook: Callable[..., object], meta: dict[str, Any]) -> None:
    """Write the run's checkpoint to ``path``: engines, RNG, ``meta``, then progress, module and callbacks.

    A collective (every rank calls it); ``on_save_checkpoint`` is dispatched with the state dict before it
    is written, so a callback may add to it.
    """

    def make_state() -> dict[str, Any]:
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            **progress.state_dict(),
            "module": module.state_dict(),
            "callbacks": {cb.state_key: cb.state_dict() for cb in callbacks},
        }
        call_hook("on_save_checkpoint", state)
        return state

    write_checkpoint(path, module.engines, make_state, meta, progress.global_step)


def restore_run(path: Path, progress: Progress, module: TrainingModule, callbacks: Sequence[Callback],
                call_hook: Callable[..., object]) -> None:
    """Load a checkpoint written by :func:`save_run`: engines, progress, module and callback states, then RNG.

    The engines' models must have been checked against the checkpoint's first (``resume_check``). Every
    trainable engine's optimizer and schedule follow the current config after loading
    (``apply_optim_config``); ``on_load_checkpoint`` is dispatched with the loaded state.
    """
    load_engines(path, module.engines)
    for engine in module.engines.values():
        if getattr(engine, "optimizer", None) is not None:
            engine.apply_optim_config()  # a changed lr / schedule applies (the checkpoint restored the old)
    state = load_state(path)
    progress.load_state_dict(state)
    module.load_state_dict(state.get("module") or {})
    saved = state.get("callbacks") or {}
    for cb in callbacks:
        if cb.state_key in saved:
            cb.load_state_dict(saved[cb.state_key])
    call_hook("on_load_checkpoint", state)
    load_rng(path)


def _resolve(ckpt_path: str | os.PathLike, checkpoint_dir: Path) -> Path | None:
    if str(ckpt_path) != "last":
        path = Path(ckpt_path)
        if not (path / STATE_FILE).is_file():
            raise FileNotFoundError(f"ckpt_path={str(ckpt_path)!r} is not a complete checkpoint directory")
        return path
    found = broadcast_object(str(find_last_checkpoint(checkpoint_dir) or ""))  # rank 0's choice
    return Path(found) if found else None


def check_resume(ckpt_path: str | os.PathLike, checkpoint_dir: Path,
                 run: ResumingRun) -> tuple[Path, dict[str, Any], list[str]] | None:
    """Find ``ckpt_path``'s checkpoint and check ``run``'s settings against it, before any engine is built.

    Args:
        ckpt_path: ``"last"`` (the newest complete checkpoint in ``checkpoint_dir``, chosen on rank 0) or a
            checkpoint directory.
        checkpoint_dir: Where ``"last"`` is looked up.
        run: The resuming run's settings.

    Returns:
        ``(checkpoint directory, its meta.json, the differences that apply)``, or ``None`` when ``"last"``
        found no checkpoint.

    Raises:
        FileNotFoundError: ``ckpt_path`` is not a complete checkpoint directory.
        ResumeMismatchError: A setting that breaks the saved state differs; every rank raises it together
            (all read the same ``meta.json``).
    """
    path = _resolve(ckpt_path, checkpoint_dir)
    if path is None:
        return None
    meta = resume_check.read_meta(path)
    return path, meta, resume_check.check_run_settings(run, path, meta)
