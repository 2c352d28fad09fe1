"""The Trainer's configurable arguments and their defaults — the one source of both.

``Trainer.__init__`` takes its defaults from :class:`TrainerArgs`, and the recipes' ``trainer:`` section
(:class:`verl_trainer.configs.TrainerConfig`) extends it with recipe switches, so a default is written
once. Everything here is plain data that a YAML file can hold; callbacks and objects are passed to the
Trainer directly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["TrainerArgs"]


@dataclass
class TrainerArgs:
    """``Trainer(...)`` arguments that are plain data (see :class:`verl_trainer.Trainer` for each).

    Attributes:
        strategy: Engine backend (``fsdp2``, ``fsdp``, ``deepspeed``, ...).
        accelerator: ``auto``, ``cpu``, ``gpu``.
        devices: Processes per node (an int or ``"auto"``).
        num_nodes: Nodes.
        precision: ``32-true``, ``bf16-mixed``, ``bf16-true``.
        max_steps: Trainer steps (``-1``: limited by ``max_epochs``).
        max_epochs: Passes over the data (``None``: limited by ``max_steps``).
        logger: ``True`` (CSV), ``False``, a logger name or a list of names (``csv``, ``wandb``).
        log_every_n_steps: Logging interval.
        default_root_dir: Where logs and checkpoints go (``None``: the working directory).
        val_check_interval: Validate every N steps during fit (``None``: only through ``validate``).
        enable_progress_bar: Show the progress bar.
        enable_checkpointing: Save a checkpoint at the end of fit.
        seed: Seed of everything.
        collective_timeout: Seconds a collective waits for the other ranks before it fails (``None``: the
            strategy's, 600 s by default, verl's ``nccl_timeout``): a rank stalled in user code ends the run
            after this long instead of holding the others.
    """

    strategy: str = "fsdp2"
    accelerator: str = "auto"
    devices: Any = 1
    num_nodes: int = 1
    precision: Any = "32-true"
    max_steps: int = -1
    max_epochs: int | None = None
    logger: Any = True
    log_every_n_steps: int = 1
    default_root_dir: str | None = None
    val_check_interval: int | None = None
    enable_progress_bar: bool = True
    enable_checkpointing: bool = True
    seed: int = 42
    collective_timeout: float | None = None

    def trainer_kwargs(self) -> dict[str, Any]:
        """These values as ``Trainer(**kwargs)`` arguments (subclass fields left out)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(TrainerArgs)}
