"""The Trainer's configurable arguments and their defaults — the one source of both.

``Trainer.__init__`` takes its defaults from :class:`TrainerArgs`, and the recipes' ``trainer:`` section
(:class:`verl_trainer.configs.TrainerConfig`) extends it with recipe switches, so a default is written
once. Everything here is plain data that a YAML file can hold; callbacks and objects are passed to the
Trainer directly. The checks of these arguments live here too (``Trainer.__init__`` calls them; Lightning's
own argument checks are in ``training/lightning_args.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

__all__ = [
    "ACCELERATORS",
    "TrainerArgs",
    "check_collective_timeout",
    "check_deterministic",
    "check_fast_dev_run",
    "check_log_every_n_steps",
    "check_num_nodes",
    "check_run_length",
    "check_seed",
    "resolve_accelerator",
    "resolve_devices",
]

ACCELERATORS = ("auto", "cpu", "gpu", "cuda")


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


def resolve_accelerator(accelerator: str) -> str:
    """``accelerator`` as the device type the run uses (``"cuda"`` or ``"cpu"``).

    Raises:
        ValueError: Not one of :data:`ACCELERATORS`, or a GPU asked for where none is visible.
    """
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator={accelerator!r}; choose one of {ACCELERATORS}")
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator in ("gpu", "cuda"):
        if not torch.cuda.is_available():
            raise ValueError(
                f"accelerator={accelerator!r} but no CUDA device is available; use 'cpu' or 'auto'"
            )
        return "cuda"
    return "cpu"


def resolve_devices(devices: int | str, accelerator: str) -> int:
    """``devices`` (processes per node) as an int; ``"auto"``: every visible GPU, else 1.

    Raises:
        ValueError: Not a positive int or ``"auto"``, or more CUDA devices than are visible.
    """
    if devices == "auto":
        return max(1, torch.cuda.device_count()) if accelerator == "cuda" else 1
    if isinstance(devices, bool) or not isinstance(devices, int):
        raise ValueError(f"devices must be a positive int or 'auto', got {devices!r}")
    if devices < 1:
        raise ValueError(f"devices must be >= 1 (processes per node), got {devices}")
    if accelerator == "cuda" and devices > torch.cuda.device_count():
        raise ValueError(f"devices={devices} but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return devices


def check_collective_timeout(seconds: float, default: timedelta) -> timedelta:
    """``collective_timeout`` as a ``timedelta`` (``default``: the strategy's, named in the message).

    Raises:
        ValueError: Not a number of seconds > 0.
    """
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(
            f"collective_timeout must be a number of seconds > 0 or None (the strategy's "
            f"{default.total_seconds():.0f} s), got {seconds!r}"
        )
    return timedelta(seconds=float(seconds))


def check_num_nodes(num_nodes: int) -> int:
    """``num_nodes``, checked: an int >= 1."""
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"num_nodes must be an int >= 1, got {num_nodes!r}")
    return num_nodes


def check_run_length(max_steps: int, max_epochs: int | None) -> tuple[int, int | None]:
    """``(max_steps, max_epochs)``, checked: ``-1`` or >= 1 steps; ``None`` or >= 1 epochs."""
    if not isinstance(max_steps, int) or (max_steps < 1 and max_steps != -1):
        raise ValueError(f"max_steps must be -1 (unlimited) or >= 1, got {max_steps!r}")
    if max_epochs is not None and (not isinstance(max_epochs, int) or max_epochs < 1):
        raise ValueError(f"max_epochs must be None or >= 1, got {max_epochs!r}")
    return max_steps, max_epochs


def check_log_every_n_steps(every: int) -> int:
    """``log_every_n_steps``, checked: an int >= 1."""
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"log_every_n_steps must be an int >= 1, got {every!r}")
    return every


def check_deterministic(deterministic: bool | str) -> bool | str:
    """``deterministic``, checked: ``True``, ``False`` or ``"warn"``."""
    if deterministic not in (True, False, "warn"):
        raise ValueError(f"deterministic={deterministic!r}; use True, False or 'warn' (warn only)")
    return deterministic


def check_fast_dev_run(fast_dev_run: bool | int) -> int:
    """``fast_dev_run`` as the number of batches it runs (0: off)."""
    if isinstance(fast_dev_run, bool) or (isinstance(fast_dev_run, int) and fast_dev_run >= 0):
        return int(fast_dev_run)
    raise ValueError(f"fast_dev_run={fast_dev_run!r}; use True (1 batch), False or an int N >= 0")


def check_seed(seed: int) -> int:
    """``seed``, checked: an int."""
    if not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    return seed
