"""The demo's own parts (the arithmetic task, its validation set, the warm start) apply only to the demo.

:func:`apply_demo_scope` runs after the config is loaded and before anything runs, so that a verl user who
keeps their command line gets RL on their model and data, not an SFT on ``"a+b="`` first:

* ``warm_start.enable: auto`` runs the warm start only with the demo's own model (``model.path`` at
  :data:`~verl_trainer.recipe_config.recipes.DEMO_MODEL_PATH`, no ``algorithm.model_path``) and the demo's own
  data (``data.train_files`` inside ``task.dir``); otherwise it is off, with a printed note.
* ``warm_start.enable: true`` runs, except where it cannot do what was asked (with
  ``algorithm.model_path``, or with the user's own RL data while ``warm_start.train_files`` is still the
  demo's SFT file): those are refused with the fix.
* ``data.val_files`` still at the demo's validation set while ``data.train_files`` is the user's: the
  validation set is dropped, with a note.
* The task files are written only when some file the run reads lies in ``task.dir``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["apply_demo_scope", "uses_demo_model"]


def _inside(path: str | None, directory: str) -> bool:
    if not path:
        return False
    return Path(os.path.abspath(path)).is_relative_to(os.path.abspath(directory))


def uses_demo_model(config: Any) -> bool:
    """Whether the run starts from the demo's model (``model.path`` its, no ``algorithm.model_path``)."""
    from verl_trainer.recipe_config.recipes import DEMO_MODEL_PATH  # lazy: cycle with recipe_config.recipes

    explicit = getattr(config.algorithm, "model_path", "")
    return not explicit and os.path.normpath(config.model.path) == os.path.normpath(DEMO_MODEL_PATH)


def _users_model(config: Any) -> str:
    explicit = getattr(config.algorithm, "model_path", "")
    return f"algorithm.model_path={explicit}" if explicit else f"model.path={config.model.path}"


def _warm_start(config: Any, users_data: bool) -> list[str]:
    warm = config.warm_start
    demo_model = uses_demo_model(config)
    if warm.enable == "auto":
        warm.enable = demo_model and not users_data
        if warm.enable:
            return []
        yours = _users_model(config) if not demo_model else f"data.train_files={config.data.train_files}"
        return [f"warm_start: off (the demo's SFT warm start on the arithmetic task runs only with the "
                f"demo's own model and data; you gave {yours}). warm_start.enable=true "
                f"warm_start.train_files=<your SFT file> runs one on your model"]
    if not warm.enable:
        return []
    if getattr(config.algorithm, "model_path", ""):
        raise ValueError(
            f"warm_start.enable=true with algorithm.model_path={config.algorithm.model_path}: the policy "
            "starts from algorithm.model_path, so the warm start would not be used; give your model as "
            "model.path (the warm start's input), or set warm_start.enable=false"
        )
    if users_data and _inside(warm.train_files, config.task.dir):
        raise ValueError(
            f"warm_start.enable=true would fine-tune {_users_model(config)} on the demo's arithmetic SFT "
            f"data (warm_start.train_files={warm.train_files}) before RL on your data.train_files="
            f"{config.data.train_files}; set warm_start.train_files=<your SFT file (prompt, response)> or "
            "warm_start.enable=false"
        )
    return []


def apply_demo_scope(config: Any) -> list[str]:
    """Turn the demo's task, validation set and warm start off for a user's model or data.

    See the module docstring; ``config`` is changed in place, and a second call changes nothing.

    Args:
        config: A recipe config (``model``, ``task``, ``data``, ``algorithm``, optionally ``warm_start``);
            other configs are left alone.

    Returns:
        One note per change, for the recipe to print.

    Raises:
        ValueError: An explicit ``warm_start.enable=true`` that would not do what it says (see above).
    """
    if not all(hasattr(config, name) for name in ("model", "task", "data", "algorithm")):
        return []
    task_dir, data = config.task.dir, config.data
    users_data = not _inside(data.train_files, task_dir)
    notes = []
    if users_data and _inside(data.val_files, task_dir):
        notes.append(f"data.val_files: off (it was the demo's arithmetic validation set {data.val_files}, "
                     f"and data.train_files={data.train_files} is yours); give data.val_files=<your file> to "
                     "validate")
        data.val_files = None
    if not users_data and not uses_demo_model(config):
        notes.append(f"data: the demo's arithmetic task (data.train_files={data.train_files}) on "
                     f"{_users_model(config)}; give data.train_files=<your file> to train on your data")
    warm = getattr(config, "warm_start", None)
    if warm is not None:
        notes += _warm_start(config, users_data)
    reads = [data.train_files, data.val_files, warm.train_files if warm is not None and warm.enable else None]
    if not any(_inside(path, task_dir) for path in reads):
        config.task.write_if_missing = False  # nothing of the task is read: write nothing
    return notes
