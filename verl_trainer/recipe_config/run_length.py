"""How many steps a recipe runs, from ``trainer.max_steps`` and ``trainer.max_epochs``, as verl counts them.

verl derives its step count from epochs: ``total_training_steps = len(train_dataloader) * total_epochs``
(full batches: ``train_rows // train_batch_size``), and writes it into the optimizers' schedules. The
recipes do the same once the training data is read (``recipes/common.py: prepare``):

* ``max_epochs`` alone (on the command line, ours or verl's ``trainer.total_epochs``, the config file's
  ``max_steps`` is dropped: :func:`epochs_set_the_length`): ``max_epochs × steps per epoch`` steps.
* ``max_steps`` and ``max_epochs`` both: both are limits and the first one reached ends the run (Lightning,
  and verl's own loop, which also ends after ``total_epochs``); the run is
  ``min(max_steps, max_epochs × steps per epoch)`` steps.
* the learning-rate schedule of every optimizer that followed the run's length (``total_training_steps``
  equal to ``trainer.max_steps`` through the YAML's ``${trainer.max_steps}``, or verl's ``-1``) spans the
  steps actually run. (verl's schedule spans ``total_training_steps`` even when the epochs end the run
  first, and never reaches its end then.)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from verl_trainer.data.loader_position import limited_batches
from verl_trainer.engine.config import RUN_LENGTH, OptimConfig

__all__ = ["epochs_set_the_length", "run_length", "with_schedule_length"]


def _given(overrides: Sequence[str], key: str) -> bool:
    return any(o.partition("=")[0].strip() == key for o in overrides)


def epochs_set_the_length(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """``trainer.max_epochs=N`` on the command line without ``trainer.max_steps``: the epochs set the length.

    Args:
        overrides: Our ``key=value`` overrides (verl keys already translated).

    Returns:
        ``(overrides, notes)``: ``trainer.max_steps=-1`` appended (the config file's ``max_steps`` is not a
        limit then), and a note saying so.
    """
    if not _given(overrides, "trainer.max_epochs") or _given(overrides, "trainer.max_steps"):
        return list(overrides), []
    note = ("trainer.max_epochs given without trainer.max_steps: the epochs set the run's length (verl's "
            "total_epochs), the config file's max_steps is dropped; add trainer.max_steps (verl: "
            "trainer.total_training_steps) to cap it")
    return [*overrides, "trainer.max_steps=-1"], [note]


def run_length(max_steps: int, max_epochs: int | None, batches_per_epoch: int,
               accumulate_grad_batches: int = 1, limit_train_batches: Any = None) -> tuple[int, str]:
    """The optimizer steps a run makes, and a line that says how they were counted.

    Args:
        max_steps: ``trainer.max_steps`` (``-1``: no step limit).
        max_epochs: ``trainer.max_epochs`` (``None``: no epoch limit).
        batches_per_epoch: Loader batches of one epoch (full batches; see
            :meth:`~verl_trainer.algorithms.data.PromptDataModule.batches_per_epoch`).
        accumulate_grad_batches: Loader batches per optimizer step (a partial group ends each epoch).
        limit_train_batches: ``trainer.limit_train_batches``.

    Raises:
        ValueError: Neither limit set.
    """
    if max_epochs is None:
        if max_steps < 0:
            raise ValueError("set trainer.max_steps or trainer.max_epochs (verl: "
                             "trainer.total_training_steps or trainer.total_epochs) to say how long to train")
        return max_steps, f"run length: trainer.max_steps={max_steps} steps"
    per_epoch = math.ceil(limited_batches(batches_per_epoch, limit_train_batches) / accumulate_grad_batches)
    by_epochs = max_epochs * per_epoch
    how = f"trainer.max_epochs={max_epochs} x {per_epoch} steps per epoch = {by_epochs}"
    if max_steps < 0:
        return by_epochs, f"run length: {how} steps"
    if max_steps < by_epochs:
        return max_steps, f"run length: {max_steps} steps (trainer.max_steps ends it before {how})"
    return by_epochs, f"run length: {by_epochs} steps ({how} ends it before trainer.max_steps={max_steps})"


def with_schedule_length(config: Any, followed: int, steps: int) -> tuple[Any, list[str]]:
    """``config`` with every ``OptimConfig`` that followed the run's length set to ``steps``.

    Args:
        config: A dataclass tree (an algorithm config).
        followed: The value a schedule that followed the run's length holds (``trainer.max_steps`` as
            configured); :data:`~verl_trainer.engine.config.RUN_LENGTH` (``-1``) always counts.
        steps: The run's length.

    Returns:
        ``(config, paths)``: a copy with those schedules set, and their dotted paths.
    """
    if isinstance(config, OptimConfig):
        if config.total_training_steps in (followed, RUN_LENGTH) and config.total_training_steps != steps:
            return dataclasses.replace(config, total_training_steps=steps), [""]
        return config, []
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        return config, []
    changes, paths = {}, []
    for f in dataclasses.fields(config):
        value, inner = with_schedule_length(getattr(config, f.name), followed, steps)
        if inner:
            changes[f.name] = value
            paths += [f"{f.name}.{p}".rstrip(".") for p in inner]
    return (dataclasses.replace(config, **changes) if changes else config), paths
