"""The Trainer's arguments: their defaults, their checks, and the callbacks' order — the one source of each.

``Trainer.__init__`` takes its defaults from :class:`TrainerArgs` (plain data a YAML file can hold), which the
recipes' ``trainer:`` section (:class:`verl_trainer.recipe_config.TrainerConfig`) extends.
:func:`check_trainer_args` checks every argument in the order they are listed (a test may depend on which
error comes first), applies ``fast_dev_run``'s overrides as in Lightning, and returns :class:`CheckedArgs`;
the Trainer and the recipes' configs reject a bad value the same way, before any process starts. Callback
order: ``MetricReduction`` first, the user's callbacks in the given order (the default ``ProgressBar`` after
them), ``ModelCheckpoint`` callbacks last, as in Lightning. Lightning's names with no meaning here:
``training/lightning_compat.py``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from verl_trainer.callbacks import Callback, MetricReduction, ModelCheckpoint, ProgressBar
from verl_trainer.callbacks.base import check_callback
from verl_trainer.training.loggers import validate_logger_spec
from verl_trainer.training.strategy import Strategy, check_precision, normalize_precision, resolve_strategy
from verl_trainer.utils.durations import parse_max_time

__all__ = [
    "ACCELERATORS",
    "CheckedArgs",
    "TrainerArgs",
    "as_callback_list",
    "check_accumulate",
    "check_collective_timeout",
    "check_deterministic",
    "check_fast_dev_run",
    "check_gradient_clip",
    "check_limit",
    "check_log_every_n_steps",
    "check_num_nodes",
    "check_optional_count",
    "check_run_length",
    "check_seed",
    "check_trainer_args",
    "check_val_check_interval",
    "order_callbacks",
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
        precision: ``32-true``, ``bf16-mixed``, ``bf16-true``, ``16-mixed`` (see ``check_precision``).
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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_limit(name: str, value: Any) -> int | float | None:
    """``limit_*_batches``: ``None`` (all), an int >= 0 (batches) or a float in ``[0, 1]`` (fraction).

    Raises:
        ValueError: Any other value.
    """
    if value is None or (_is_int(value) and value >= 0):
        return value
    if isinstance(value, float) and 0.0 <= value <= 1.0:
        return 1.0 if value == 1.0 else value
    raise ValueError(
        f"{name}={value!r}; use an int >= 0 (batches), a float in [0, 1] (fraction of the batches) or None "
        "(all)"
    )


def check_val_check_interval(value: Any) -> int | float | None:
    """``val_check_interval``: ``None``, an int >= 1 (trainer steps) or a float in ``(0, 1]`` (epoch).

    Raises:
        ValueError: Any other value.
    """
    if value is None or (_is_int(value) and value >= 1):
        return value
    if isinstance(value, float) and 0.0 < value <= 1.0:
        return value
    raise ValueError(
        f"val_check_interval={value!r}; use an int >= 1 (every N trainer steps), a float in (0, 1] (every "
        "fraction of an epoch: 0.5 validates twice per epoch) or None (no validation during fit)"
    )


def check_optional_count(name: str, value: Any, minimum: int = 0) -> int | None:
    """``None`` or an int >= ``minimum``.

    Raises:
        ValueError: Any other value.
    """
    if value is None or (_is_int(value) and value >= minimum):
        return value
    raise ValueError(f"{name}={value!r}; use None or an int >= {minimum}")


def check_accumulate(value: Any) -> int:
    """``accumulate_grad_batches``: an int >= 1 (a dict schedule is not supported).

    Raises:
        ValueError: Any other value.
    """
    if _is_int(value) and value >= 1:
        return value
    raise ValueError(
        f"accumulate_grad_batches={value!r}; use an int >= 1 (loader batches per optimizer step; a schedule "
        "that changes it by epoch is not supported: it would change the global batch mid-run)"
    )


def check_gradient_clip(value: Any, algorithm: Any) -> float | None:
    """``gradient_clip_val`` (``None``, or a number >= 0) with ``gradient_clip_algorithm`` ``"norm"``.

    Returns:
        The clip value (``None``: the modules' ``OptimConfig.clip_grad`` applies).

    Raises:
        ValueError: A negative or non-numeric value, or an algorithm other than ``"norm"``.
    """
    if algorithm not in (None, "norm"):
        raise ValueError(
            f"gradient_clip_algorithm={algorithm!r} is not supported; the engines clip the total gradient "
            "norm over all shards (FSDP / ZeRO compute it globally): use gradient_clip_algorithm='norm' "
            "(or None)"
        )
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"gradient_clip_val={value!r}; use a number >= 0 (0: no clipping) or None")
    return float(value)


def as_callback_list(callbacks: Sequence[Callback] | Callback | None) -> list[Callback]:
    """``callbacks`` (one, a sequence or ``None``) as a new list."""
    if callbacks is None:
        return []
    if isinstance(callbacks, Sequence) and not isinstance(callbacks, str):
        return list(callbacks)
    return [callbacks]


def order_callbacks(
    callbacks: Sequence[Callback] | Callback | None, progress_bar: bool, checkpointing: bool
) -> list[Callback]:
    """The checked callbacks in their fixed order, the default ones added.

    Raises:
        ValueError: A ProgressBar / ModelCheckpoint given while its ``enable_*`` flag is off, or two
            callbacks with one ``state_key``.
    """
    given = as_callback_list(callbacks)
    for cb in given:
        check_callback(cb)
    if any(isinstance(cb, ProgressBar) for cb in given) and not progress_bar:
        raise ValueError("a ProgressBar is in callbacks but enable_progress_bar=False; drop one of them")
    if any(isinstance(cb, ModelCheckpoint) for cb in given) and not checkpointing:
        raise ValueError("a ModelCheckpoint is in callbacks but enable_checkpointing=False; drop one of them")
    reduction = [cb for cb in given if isinstance(cb, MetricReduction)] or [MetricReduction()]
    checkpoints = [cb for cb in given if isinstance(cb, ModelCheckpoint)]
    if checkpointing and not checkpoints:
        checkpoints = [ModelCheckpoint()]
    middle = [cb for cb in given if not isinstance(cb, (MetricReduction, ModelCheckpoint))]
    if progress_bar and not any(isinstance(cb, ProgressBar) for cb in middle):
        middle.append(ProgressBar())
    ordered = reduction[:1] + middle + checkpoints
    keys = [cb.state_key for cb in ordered]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    if dupes:
        raise ValueError(f"callbacks share the state key(s) {dupes}; give each a distinct `state_key`")
    return ordered


@dataclass
class CheckedArgs:
    """The Trainer's arguments after checking (each field is the Trainer attribute of the same name).

    ``logger`` is the logger spec to build (``False`` under ``fast_dev_run``); ``callbacks`` are ordered.
    """

    strategy: Strategy
    accelerator: str
    devices: int
    num_nodes: int
    precision: str
    max_steps: int
    max_epochs: int | None
    log_every_n_steps: int
    val_check_interval: int | float | None
    check_val_every_n_epoch: int | None
    accumulate_grad_batches: int
    gradient_clip_val: float | None
    gradient_clip_algorithm: str
    limits: dict[str, int | float | None]
    max_time: timedelta | None
    min_steps: int | None
    min_epochs: int | None
    num_sanity_val_steps: int
    deterministic: bool | str
    fast_dev_run: int
    seed: int
    default_root_dir: str
    logger: Any
    callbacks: list[Callback]


def check_trainer_args(
    *, strategy: str | Strategy, accelerator: str, devices: int | str, num_nodes: int, precision: str | int,
    max_steps: int, max_epochs: int | None, callbacks: Sequence[Callback] | Callback | None, logger: Any,
    log_every_n_steps: int, default_root_dir: str | os.PathLike | None, val_check_interval: int | None,
    enable_progress_bar: bool, enable_checkpointing: bool, seed: int, collective_timeout: float | None,
    accumulate_grad_batches: int, gradient_clip_val: float | None, gradient_clip_algorithm: str | None,
    limit_train_batches: int | float | None, limit_val_batches: int | float | None,
    limit_test_batches: int | float | None, limit_predict_batches: int | float | None,
    fast_dev_run: bool | int, max_time: str | timedelta | Mapping[str, int] | None, min_steps: int | None,
    min_epochs: int | None, check_val_every_n_epoch: int | None, num_sanity_val_steps: int,
    deterministic: bool | str,
) -> CheckedArgs:
    """Check and resolve ``Trainer(...)``'s arguments (see :class:`verl_trainer.Trainer` for each).

    Raises:
        ValueError: For an invalid argument or combination; the message says what to change.
    """
    strat = resolve_strategy(strategy)
    if collective_timeout is not None:
        strat.timeout = check_collective_timeout(collective_timeout, strat.timeout)
    acc = resolve_accelerator(accelerator)
    n_devices = resolve_devices(devices, acc)
    nodes = check_num_nodes(num_nodes)
    prec = check_precision(normalize_precision(precision), acc, strat.backend)
    steps, epochs = check_run_length(max_steps, max_epochs)
    every_n = check_log_every_n_steps(log_every_n_steps)
    interval = check_val_check_interval(val_check_interval)
    val_every_epoch = check_optional_count("check_val_every_n_epoch", check_val_every_n_epoch, 1)
    accumulate = check_accumulate(accumulate_grad_batches)
    clip = check_gradient_clip(gradient_clip_val, gradient_clip_algorithm)
    limits = {kind: check_limit(f"limit_{kind}_batches", value) for kind, value in (
        ("train", limit_train_batches), ("val", limit_val_batches), ("test", limit_test_batches),
        ("predict", limit_predict_batches))}
    time_limit = parse_max_time(max_time)
    min_s = check_optional_count("min_steps", min_steps)
    min_e = check_optional_count("min_epochs", min_epochs)
    sanity = check_optional_count("num_sanity_val_steps", num_sanity_val_steps, -1)
    determ = check_deterministic(deterministic)
    dev_run = check_fast_dev_run(fast_dev_run)
    if dev_run:  # Lightning's meaning: N train and N val batches, one epoch, nothing written
        steps, epochs, time_limit = dev_run, 1, None
        limits.update(train=dev_run, val=dev_run, test=dev_run, predict=dev_run)
        interval, val_every_epoch, sanity = None, 1, 0
        logger, enable_checkpointing = False, False
        callbacks = [cb for cb in as_callback_list(callbacks) if not isinstance(cb, ModelCheckpoint)]
    checked_seed = check_seed(seed)
    validate_logger_spec(logger)
    root = os.fspath(Path(default_root_dir or os.getcwd()).absolute())
    ordered = order_callbacks(callbacks, enable_progress_bar, enable_checkpointing)
    return CheckedArgs(
        strategy=strat, accelerator=acc, devices=n_devices, num_nodes=nodes, precision=prec,
        max_steps=steps, max_epochs=epochs, log_every_n_steps=every_n, val_check_interval=interval,
        check_val_every_n_epoch=val_every_epoch, accumulate_grad_batches=accumulate, gradient_clip_val=clip,
        gradient_clip_algorithm="norm", limits=limits, max_time=time_limit, min_steps=min_s,
        min_epochs=min_e, num_sanity_val_steps=sanity, deterministic=determ, fast_dev_run=dev_run,
        seed=checked_seed, default_root_dir=root, logger=logger, callbacks=ordered,
    )
