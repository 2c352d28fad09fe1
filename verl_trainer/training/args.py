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
        precision: ``32-true``, ``bf16-mixed``, ``bf16-true``, ``16-mixed`` (CUDA only).
        max_steps: Trainer steps (``-1``: limited by ``max_epochs``).
        max_epochs: Passes over the data (``None``: limited by ``max_steps``).
        logger: ``True`` (CSV), ``False``, a logger name or a list of names (``csv``, ``wandb``).
        log_every_n_steps: Logging interval.
        default_root_dir: Where logs and checkpoints go (``None``: the working directory).
        val_check_interval: Validate every N trainer steps (an int) or every fraction of an epoch (a float in
            ``(0, 1]``) during fit (``None``: at the end of the epochs ``check_val_every_n_epoch`` selects).
        enable_progress_bar: Show the progress bar.
        enable_checkpointing: Save a checkpoint at the end of fit.
        seed: Seed of everything.
        collective_timeout: Seconds a collective waits for the other ranks before it fails (``None``: the
            strategy's, 600 s by default, verl's ``nccl_timeout``): a rank stalled in user code ends the run
            after this long instead of holding the others.
        accumulate_grad_batches: Loader batches per optimizer step: K consecutive batches are joined into
            one step batch, so the global denominators span all K (exact, unlike summing K scaled steps).
        gradient_clip_val: Max total grad norm (overrides the modules' ``OptimConfig.clip_grad``; ``0``:
            no clipping; ``None``: the module's).
        gradient_clip_algorithm: ``"norm"`` (``None`` = ``"norm"``); ``"value"`` is not supported.
        limit_train_batches: Loader batches per training epoch: an int, or a fraction of the epoch.
        limit_val_batches: Validation batches per validation run: an int, or a fraction.
        limit_test_batches: Test batches per ``test`` run: an int, or a fraction.
        limit_predict_batches: Batches per ``predict`` run: an int, or a fraction.
        fast_dev_run: ``True`` (1) or N: run N training and N validation batches, no checkpoint, no logger.
        max_time: Stop fit after this wall time (``"DD:HH:MM:SS"``, a ``timedelta`` or a dict of
            ``timedelta`` arguments), decided on rank 0 for every rank.
        min_steps: Trainer steps before a stop request (``EarlyStopping``) is honoured.
        min_epochs: Epochs before a stop request is honoured.
        check_val_every_n_epoch: Validate at the end of every N-th epoch when there is validation data
            (Lightning's default, 1: every epoch; ``None``: not per epoch, only ``val_check_interval``).
        num_sanity_val_steps: Validation batches run before the first training step (``-1``: all); their
            metrics are not logged.
        deterministic: ``True``: ``torch.use_deterministic_algorithms(True)``; ``"warn"``: warn only.
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
    val_check_interval: Any = None
    enable_progress_bar: bool = True
    enable_checkpointing: bool = True
    seed: int = 42
    collective_timeout: float | None = None
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str | None = None
    limit_train_batches: Any = None
    limit_val_batches: Any = None
    limit_test_batches: Any = None
    limit_predict_batches: Any = None
    fast_dev_run: Any = False
    max_time: Any = None
    min_steps: int | None = None
    min_epochs: int | None = None
    check_val_every_n_epoch: int | None = 1
    num_sanity_val_steps: int = 0
    deterministic: Any = False

    def trainer_kwargs(self) -> dict[str, Any]:
        """These values as ``Trainer(**kwargs)`` arguments (subclass fields left out)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(TrainerArgs)}
