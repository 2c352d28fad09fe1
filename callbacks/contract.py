"""What a callback may use of the trainer and the module its hooks are handed.

:class:`verl_trainer.Trainer` and :class:`verl_trainer.module.TrainingModule` satisfy these protocols; the
callbacks depend on them, not on those classes, which sit on layers above the callbacks
(``docs/architecture.md``, the layer table).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch.distributed as dist

from verl_trainer.engine.base import BaseEngine
from verl_trainer.metrics import Metric

__all__ = ["CallbackModule", "CallbackTrainer"]


class CallbackModule(Protocol):
    """The module's declared contract as a callback may read it."""

    engines: Mapping[str, BaseEngine]
    """The initialised engines by name (empty before fit / validate builds them)."""

    @property
    def actor(self) -> BaseEngine:
        """The first engine: its model and data-parallel layout describe the run."""

    @property
    def hidden_size(self) -> int:
        """The actor model's hidden size."""

    @property
    def required_batch_multiple(self) -> int:
        """The multiple (in samples) the global update batch must have."""


class CallbackTrainer(Protocol):
    """The trainer's state and actions as a callback may use them (on every rank alike)."""

    should_stop: bool
    """Set to stop fit after the current step (every rank must agree)."""

    max_steps: int
    """Trainer steps to run (``-1``: limited by the epochs)."""

    precision: str
    """The run's precision (``"bf16-mixed"``, ``"32-true"``, ...)."""

    accelerator: str
    """``"cpu"`` or ``"cuda"`` once resolved."""

    default_root_dir: str | os.PathLike
    """Where logs, checkpoints and generations go."""

    module: CallbackModule | None
    """The module being run (``None`` outside fit / validate / test / predict)."""

    callbacks: Sequence[object]
    """The run's callbacks, in dispatch order."""

    val_loader: object
    """The validation loader (``None``: no validation data)."""

    @property
    def global_step(self) -> int:
        """Optimizer steps done."""

    @property
    def current_epoch(self) -> int:
        """The training epoch (0-based)."""

    @property
    def state(self) -> str | None:
        """``"fit"``, ``"validate"``, ``"test"``, ``"predict"`` while one runs; else ``None``."""

    @property
    def sanity_checking(self) -> bool:
        """Inside the sanity validation at the start of fit."""

    @property
    def is_global_zero(self) -> bool:
        """True on global rank 0."""

    @property
    def world_size(self) -> int:
        """Processes of the run."""

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The data-parallel group (``None``: the whole world)."""

    @property
    def callback_metrics(self) -> dict[str, float]:
        """The last reduced metrics of training and validation, by name."""

    def log_metrics(self, metrics: Mapping[str, Metric | float]) -> None:
        """Log ``metrics`` at the current step (call on every rank; reductions as declared)."""

    def validation_due(self) -> bool:
        """Whether validation runs after the current training step."""

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Save a resumable checkpoint to ``path`` (a collective: every rank calls it)."""
