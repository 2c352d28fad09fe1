"""``Trainer(...)``'s arguments checked in one place: :func:`check_trainer_args` returns :class:`CheckedArgs`.

The checks run in the order the arguments are listed (a test may depend on which error comes first), and
``fast_dev_run`` overrides the run length, the limits, validation, logging and checkpointing as in
Lightning.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from verl_trainer.callbacks import Callback, ModelCheckpoint
from verl_trainer.training.args import (
    check_collective_timeout,
    check_deterministic,
    check_fast_dev_run,
    check_log_every_n_steps,
    check_num_nodes,
    check_run_length,
    check_seed,
    resolve_accelerator,
    resolve_devices,
)
from verl_trainer.training.callback_order import as_callback_list, order_callbacks
from verl_trainer.training.lightning_args import (
    check_accumulate,
    check_gradient_clip,
    check_limit,
    check_optional_count,
    check_val_check_interval,
    parse_max_time,
)
from verl_trainer.training.loggers import validate_logger_spec
from verl_trainer.training.strategy import Strategy, check_precision, normalize_precision, resolve_strategy

__all__ = ["CheckedArgs", "check_trainer_args"]


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
