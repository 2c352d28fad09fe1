"""The Trainer: Lightning's arguments and loop shape, verl's engines underneath, SPMD on every rank.

::

    trainer = Trainer(strategy="fsdp2", devices=2, max_steps=50, logger="wandb",
                      callbacks=[ModelCheckpoint(every_n_train_steps=10)])
    trainer.fit(SFT(config), datamodule=data, ckpt_path="last")

Every rank runs the Trainer, a façade: ``fit`` starts or joins the process world
(``verl_trainer.training.launch``), builds the module's engines with the strategy, shards the data by
data-parallel rank, restores a checkpoint, and hands the run to
:class:`~verl_trainer.training.fit_loop.FitLoop` (evaluation:
:class:`~verl_trainer.training.evaluation.EvaluationLoop`), which owns the run's
:class:`~verl_trainer.training.progress.Progress`; the Lightning attributes (``global_step``,
``current_epoch``, ``should_stop``, ...) read it. Invalid arguments fail at construction.

Invariants: callbacks run in ``training/arguments.py``'s fixed order (``MetricReduction`` first, the user's in
the given order, ``ModelCheckpoint`` last); a step's metrics are logged on rank 0 after
``on_train_batch_end``, or earlier when a checkpoint is saved, so a checkpoint never precedes its own step in
the logs. The parts: docs/lightning.md, "The Trainer's parts".
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import random
import warnings
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from verl_trainer.callbacks import Callback, MetricReduction, ModelCheckpoint, ProgressBar
from verl_trainer.callbacks.base import HOOK_NAMES
from verl_trainer.data.sharded_loader import ShardedLoader, refuse_raw_rows
from verl_trainer.engine.config import EngineSpec
from verl_trainer.engine.hooks import STEP_HOOK_NAMES, StepHooks
from verl_trainer.metrics import Metric
from verl_trainer.module import TrainingModule
from verl_trainer.rollout_pool.current import current_pool
from verl_trainer.rollout_pool.world import split_world
from verl_trainer.training import checkpoint, failure, launch, resume_check
from verl_trainer.training.arguments import TrainerArgs, check_trainer_args
from verl_trainer.training.evaluation import EVAL_STAGES, EvaluationLoop
from verl_trainer.training.fit_loop import FitLimits, FitLoop
from verl_trainer.training.lightning_compat import (
    LightningAttributes,
    check_lightning_habits,
    fit_data,
    reject_unknown_args,
    stage_data,
    stage_loader,
)
from verl_trainer.training.logging import MetricLogging
from verl_trainer.training.preflight import preflight_check
from verl_trainer.training.progress import Progress
from verl_trainer.training.strategy import Strategy
from verl_trainer.utils.distributed import barrier

if TYPE_CHECKING:
    from lightning.fabric.loggers import Logger

    from verl_trainer.training.loggers import LoggerSpec

__all__ = ["Trainer"]

_DEFAULTS = TrainerArgs()  # the one source of the defaults (the recipes' TrainerConfig extends it)
_CHAINED_HOOKS = frozenset({"on_before_update"})
CkptPath = str | os.PathLike | None
"""``ckpt_path``: ``None`` (fresh), ``"last"`` or a checkpoint directory."""


def _listens(callback: Callback, hook: str) -> bool:
    """Whether ``callback`` implements ``hook``: what it answers for the name is not the base no-op."""
    return getattr(getattr(callback, hook), "__func__", None) is not getattr(Callback, hook)


class Trainer(LightningAttributes):
    """Fits a :class:`~verl_trainer.module.TrainingModule` with a strategy's engines.

    Args:
        strategy: An engine backend registered with ``EngineRegistry`` (``"fsdp2"``, ``"fsdp"``,
            ``"deepspeed"``, ``"deepspeed_stage_3"``, ...) or a
            :class:`~verl_trainer.training.strategy.Strategy`.
        accelerator: ``"auto"``, ``"cpu"``, ``"gpu"`` / ``"cuda"``.
        devices: Processes per node (an int or ``"auto"``).
        num_nodes: Number of nodes.
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"`` or ``"16-mixed"`` (``32``, ``"bf16"``,
            ``16`` accepted; where each runs: :func:`~verl_trainer.training.strategy.check_precision`).
        max_steps: Trainer steps to run (``-1``: limited by ``max_epochs``).
        max_epochs: Passes over the training data (``None``: limited by ``max_steps``).
        callbacks: Callbacks (see the module docstring for their order).
        logger: ``True`` (CSV), ``False``, ``"csv"``, ``"wandb"``, a Lightning ``Logger`` or a list.
        log_every_n_steps: Log the step metrics every N steps (and on the last step).
        default_root_dir: Where logs and checkpoints go (default: the working directory).
        val_check_interval: Validate every N trainer steps (``None``: only through ``validate``).
        enable_progress_bar: Add a :class:`~verl_trainer.callbacks.ProgressBar` unless one is given.
        enable_checkpointing: Add a :class:`~verl_trainer.callbacks.ModelCheckpoint` (saves at the end of
            fit) unless one is given.
        seed: Seeds Python, numpy and torch on every rank, the engines' initialisation and the data order.
        collective_timeout: Seconds a collective waits for the other ranks before the run fails (``None``:
            the strategy's ``timeout``, 600 s by default).

    Raises:
        ValueError: For an invalid argument or combination; the message says what to change.
    """

    def __init__(
        self,
        strategy: str | Strategy = _DEFAULTS.strategy,
        accelerator: str = _DEFAULTS.accelerator,
        devices: int | str = _DEFAULTS.devices,
        num_nodes: int = _DEFAULTS.num_nodes,
        precision: str | int = _DEFAULTS.precision,
        max_steps: int = _DEFAULTS.max_steps,
        max_epochs: int | None = _DEFAULTS.max_epochs,
        callbacks: Sequence[Callback] | Callback | None = None,
        logger: LoggerSpec = _DEFAULTS.logger,
        log_every_n_steps: int = _DEFAULTS.log_every_n_steps,
        default_root_dir: str | os.PathLike | None = _DEFAULTS.default_root_dir,
        val_check_interval: int | None = _DEFAULTS.val_check_interval,
        enable_progress_bar: bool = _DEFAULTS.enable_progress_bar,
        enable_checkpointing: bool = _DEFAULTS.enable_checkpointing,
        seed: int = _DEFAULTS.seed,
        collective_timeout: float | None = _DEFAULTS.collective_timeout,
        accumulate_grad_batches: int = _DEFAULTS.accumulate_grad_batches,
        gradient_clip_val: float | None = _DEFAULTS.gradient_clip_val,
        gradient_clip_algorithm: str | None = _DEFAULTS.gradient_clip_algorithm,
        limit_train_batches: int | float | None = _DEFAULTS.limit_train_batches,
        limit_val_batches: int | float | None = _DEFAULTS.limit_val_batches,
        limit_test_batches: int | float | None = _DEFAULTS.limit_test_batches,
        limit_predict_batches: int | float | None = _DEFAULTS.limit_predict_batches,
        fast_dev_run: bool | int = _DEFAULTS.fast_dev_run,
        max_time: str | timedelta | Mapping[str, int] | None = _DEFAULTS.max_time,
        min_steps: int | None = _DEFAULTS.min_steps,
        min_epochs: int | None = _DEFAULTS.min_epochs,
        check_val_every_n_epoch: int | None = _DEFAULTS.check_val_every_n_epoch,
        num_sanity_val_steps: int = _DEFAULTS.num_sanity_val_steps,
        deterministic: bool | str = _DEFAULTS.deterministic,
        **unsupported: Any,
    ) -> None:
        names = inspect.signature(Trainer.__init__).parameters
        reject_unknown_args(unsupported, [n for n in names if n not in ("self", "unsupported")])
        args = {n: v for n, v in locals().items() if n in names and n not in ("self", "unsupported")}
        checked = check_trainer_args(**args)
        for name, value in vars(checked).items():
            if name != "logger":  # ``logger`` is a property (the first built logger)
                setattr(self, name, value)
        self.logging = MetricLogging(checked.logger, self.default_root_dir, self.log_every_n_steps)
        self._env = launch.select_cluster_environment()
        self._env.validate_settings(num_devices=self.devices, num_nodes=self.num_nodes)
        launch.check_launchable(self._env, self.devices, self.num_nodes)
        # run state
        self.world: launch.World | None = None
        self.module: TrainingModule | None = None
        self.datamodule: Any = None  # set by fit / validate / test / predict (Lightning's attribute)
        self.progress = Progress()  # owned by the stage's loops; the properties below read it
        self.fit_loop: FitLoop | None = None  # the latest fit's loop
        self.resume_changes: list[str] = []  # what changed since the checkpoint a fit resumed from (applied)
        self.val_loader: ShardedLoader | None = None
        self.eval_loader: ShardedLoader | None = None  # test / predict data
        self.step_hooks = self.callback_step_hooks()

    # ------------------------------------------------------------------------------------ progress
    @property
    def state(self) -> str | None:
        """The running stage (``"fit"``, ``"validate"``, ``"test"``, ``"predict"``), else ``None``."""
        return self.progress.stage

    @property
    def global_step(self) -> int:
        """Optimizer steps done (restored on resume)."""
        return self.progress.global_step

    @global_step.setter
    def global_step(self, value: int) -> None:
        self.progress.global_step = value

    @property
    def should_stop(self) -> bool:
        """A stop request (callbacks set it); fit honours it after ``min_steps`` / ``min_epochs``."""
        return self.progress.should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self.progress.should_stop = value

    @property
    def train_loader(self) -> ShardedLoader | None:
        """This rank's training data during ``fit`` (its epoch and position are the fit's)."""
        return self.progress.train_loader

    @property
    def sanity_checking(self) -> bool:
        """Inside the sanity-check validation at the start of fit."""
        return self.progress.sanity_checking

    @property
    def evaluating(self) -> bool:
        """Inside a validation / test / predict loop."""
        return self.progress.evaluating

    @property
    def last_validation(self) -> tuple[int, dict[str, float]] | None:
        """``(global_step, reduced metrics)`` of the latest validation pass of fit or validate.

        Sanity checks are excluded; a recipe reuses it instead of validating the same weights twice.
        """
        return self.progress.last_validation

    # ------------------------------------------------------------------------------------ topology
    @property
    def global_rank(self) -> int:
        """This process's global rank (0 before fit)."""
        return self.world.rank if self.world else 0

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""
        return self.world.local_rank if self.world else 0

    @property
    def world_size(self) -> int:
        """Number of processes."""
        return self.world.world_size if self.world else self.devices * self.num_nodes

    @property
    def is_global_zero(self) -> bool:
        """True on global rank 0 (it logs and shows the progress bar)."""
        return self.global_rank == 0

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The run's data-parallel group (the strategy's topology); ``None``: the whole world.

        Callbacks that move samples between ranks (``SequenceBalancing``) all-gather and exchange over it.
        """
        return self.strategy.data_parallel(self.global_rank, self.world_size)[0]

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel rank (the global rank before the topology exists)."""
        return self.strategy.data_parallel(self.global_rank, self.world_size)[1]

    @property
    def dp_size(self) -> int:
        """The data-parallel size (the world size before the topology exists)."""
        return self.strategy.data_parallel(self.global_rank, self.world_size)[2]

    # ------------------------------------------------------------------------------------ callbacks
    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        """The first ModelCheckpoint callback, if any."""
        return next((cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)), None)

    @property
    def metric_group(self) -> dist.ProcessGroup | None:
        """The group the loops reduce step and evaluation outputs over (``MetricReduction.group``)."""
        reduction = next((cb for cb in self.callbacks if isinstance(cb, MetricReduction)), None)
        return self.dp_group if reduction is not None and reduction.group == "dp" else None

    @property
    def progress_bar_callback(self) -> ProgressBar | None:
        """The ProgressBar callback, if any."""
        return next((cb for cb in self.callbacks if isinstance(cb, ProgressBar)), None)

    def call_hook(self, hook: str, *args: Any) -> Any:
        """Call ``hook(trainer, module, *args)`` on every callback in order (the one dispatch function).

        ``on_before_update`` is chained: a callback that returns a batch replaces it for the callbacks
        after it, and the final batch is returned. Other hooks return ``None``.

        Raises:
            ValueError: For a name that is not a callback hook.
        """
        if hook not in HOOK_NAMES:
            raise ValueError(f"unknown hook {hook!r}; hooks: {', '.join(sorted(HOOK_NAMES))}")
        chained = hook in _CHAINED_HOOKS
        for cb in self.callbacks:
            if not _listens(cb, hook):
                continue  # the base class's no-op
            out = getattr(cb, hook)(self, self.module, *args)
            if chained and out is not None:
                args = (out, *args[1:])
        return args[0] if chained else None

    def callback_step_hooks(self) -> StepHooks:
        """The engine's optimizer-step hooks: each one some callback implements dispatches to the callbacks.

        The others stay ``None``, so the engine makes no call for them (``trainer.step_hooks``, set at
        construction and again when a stage starts).
        """
        return StepHooks(**{name: functools.partial(self.call_hook, name) for name in STEP_HOOK_NAMES
                            if any(_listens(cb, name) for cb in self.callbacks)})

    def call_before_update(self, batch: Any) -> Any:
        """Deprecated alias of ``call_hook("on_before_update", batch)``, the one dispatch."""
        return self.call_hook("on_before_update", batch)

    # -------------------------------------------------------------------------------------- logging
    @property
    def loggers(self) -> list[Logger]:
        """The loggers (built on rank 0 at fit; empty on the other ranks)."""
        return self.logging.loggers

    @property
    def logger(self) -> Logger | None:
        """The first logger, or ``None``."""
        return self.loggers[0] if self.loggers else None

    @property
    def callback_metrics(self) -> dict[str, float]:
        """Every reduced value of the run so far (the same on every rank)."""
        return self.logging.callback_metrics

    @property
    def logged_metrics(self) -> dict[str, float]:
        """The values handed to the loggers last."""
        return self.logging.logged_metrics

    def log_metrics(self, metrics: Mapping[str, Metric | float]) -> None:
        """Add values to the current step's metrics, each with its reduction (call it on every rank).

        A :class:`~verl_trainer.metrics.Metric` is reduced as it declares over micro-batches and ranks; a
        plain number is a MEAN over ranks (the value itself when it is the same on every rank). Values are
        reduced with the module's step outputs (``MetricReduction``) or at the next flush, and logged on
        rank 0.
        """
        self.logging.add(metrics)

    def reduce_metrics(self, process_group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """Reduce the values added so far over micro-batches and ranks (a collective); returns them."""
        return self.logging.reduce(process_group)

    def flush_metrics(self, force: bool = False) -> None:
        """Log the pending values at ``global_step`` on rank 0 when due (a collective when values wait).

        Due: every ``log_every_n_steps``, the last step, or ``force``; values of a step that is not due
        are dropped, as in Lightning.
        """
        self.logging.flush(self.global_step, force, last_step=self.global_step == self.max_steps)

    # ------------------------------------------------------------------------------------- entry points
    def fit(self, module: TrainingModule, train_dataloaders: Any = None, val_dataloaders: Any = None,
            datamodule: Any = None, ckpt_path: str | os.PathLike | None = None) -> None:
        """Train ``module`` until ``max_steps`` / ``max_epochs`` (Lightning's arguments and their order).

        Args:
            module: A :class:`~verl_trainer.module.TrainingModule`.
            train_dataloaders: A DataLoader or a map-style Dataset of ready batches, or a datamodule.
            val_dataloaders: The validation DataLoader / Dataset (with ``train_dataloaders``).
            datamodule: An object with ``train_dataloader()`` (and optionally ``val_dataloader()``); no data
                at all: the module's own loaders.
            ckpt_path: ``None`` (fresh), ``"last"`` (the newest complete checkpoint; fresh with a warning
                when there is none) or a checkpoint directory.
        """
        if self.max_steps == -1 and self.max_epochs is None:
            raise ValueError("set max_steps or max_epochs to say when fit should stop")
        self._check_module(module)
        datamodule = fit_data(train_dataloaders, val_dataloaders, datamodule)
        refuse_raw_rows(datamodule, "datamodule")  # before any model loads
        self._launch("fit", module, datamodule, ckpt_path)

    def validation_due(self) -> bool:
        """Whether ``fit`` validates after the current step (``FitLoop.validation_due``; outside fit: no)."""
        return self.fit_loop is not None and self.fit_loop.validation_due()

    def validate(self, module: TrainingModule, dataloaders: Any = None,
                 ckpt_path: str | os.PathLike | None = None, verbose: bool = True,
                 datamodule: Any = None) -> list[dict[str, float]]:
        """Run the validation data once; returns ``[metrics]`` (reduced over batches and ranks).

        ``dataloaders`` (a DataLoader / Dataset, or a datamodule) or ``datamodule``: Lightning's arguments,
        in its order; ``verbose`` is accepted (nothing is printed either way).
        """
        self._check_module(module)
        return self._launch("validate", module, stage_data("validate", dataloaders, datamodule), ckpt_path)

    def test(self, module: TrainingModule, dataloaders: Any = None,
             ckpt_path: str | os.PathLike | None = None, verbose: bool = True,
             datamodule: Any = None) -> list[dict[str, float]]:
        """Run ``module.test_step`` over the test data once; returns ``[metrics]`` (reduced over ranks).

        Args:
            module: A :class:`~verl_trainer.module.TrainingModule` with ``test_step``.
            dataloaders: A DataLoader / map-style Dataset, or a datamodule.
            ckpt_path: A checkpoint to load first (``"last"`` or a directory).
            verbose: Accepted (Lightning's); nothing is printed either way.
            datamodule: An object with ``test_dataloader()`` (instead of ``dataloaders``).
        """
        self._check_module(module)
        return self._launch("test", module, stage_data("test", dataloaders, datamodule), ckpt_path)

    def predict(self, module: TrainingModule, dataloaders: Any = None, datamodule: Any = None,
                return_predictions: bool | None = None, ckpt_path: str | os.PathLike | None = None
                ) -> list[Any]:
        """Run ``module.predict_step`` over the predict data; returns this rank's outputs, batch by batch.

        Every rank predicts its shard of the data (the sampler's padding repeats included); with
        ``devices > 1`` started from a plain script, rank 0's list is returned. Lightning's arguments in
        its order (``dataloaders`` or ``datamodule``); ``return_predictions=False`` is refused (they are
        always returned).
        """
        self._check_module(module)
        if return_predictions is False:
            raise ValueError("predict(return_predictions=False): the predictions are always returned here; "
                             "drop the argument (or write them from predict_step / a callback)")
        return self._launch("predict", module, stage_data("predict", dataloaders, datamodule), ckpt_path)

    def check(self, module: TrainingModule, datamodule: Any = None) -> int:
        """Check a run's settings before any process starts or any model loads; returns the DP size.

        Every engine spec of ``module.configure_engines()`` is resolved with the strategy and precision
        (their SP and TP sizes must agree, and their product divide the world size), a saved LoRA adapter
        (``lora_adapter_path``) is checked against its base model's config, and a datamodule with
        a ``check(dp_size)`` method reads and checks its data (files, columns, lengths, batch sizes). The
        recipes call it first, so a bad setting fails in seconds, once, in the launching process.

        Raises:
            ValueError: The first problem found, naming the setting, its value and the fix.
        """
        self._check_module(module)
        return preflight_check(self.strategy, self.precision, self.seed, self.world_size, module, datamodule)

    @staticmethod
    def _check_module(module: object) -> None:
        for name in ("configure_engines", "training_step"):
            if not callable(getattr(module, name, None)):
                raise TypeError(
                    f"{type(module).__name__} is not a training module: it has no {name}(); subclass "
                    f"verl_trainer.module.TrainingModule"
                )
        check_lightning_habits(module)

    def _launch(self, stage: str, module: TrainingModule, datamodule: Any, ckpt_path: CkptPath) -> Any:
        launcher = launch.launcher_for(self._env, self.devices, self.num_nodes)
        return launcher.launch(self._run_guarded, stage, module, datamodule, ckpt_path)

    def _run_guarded(self, stage: str, module: TrainingModule, datamodule: Any, ckpt_path: CkptPath) -> Any:
        with failure.guard():
            pool = current_pool()  # a later stage in a process whose world was split: its trainer world
            self.world = pool.world if pool is not None else launch.connect(
                self._env, self.devices, self.num_nodes,
                self.strategy.dist_backend(self.accelerator), self.strategy.timeout,
            )
            if self.accelerator == "cpu":
                os.environ.setdefault("VERL_ENGINE_DEVICE", "cpu")
            if pool is None:  # placement=separate: split into trainer and rollout ranks
                pool = split_world(self.world, module, self.strategy.dist_backend(self.accelerator),
                                   self.strategy.timeout)
            if pool is not None and pool.serves_rollout:  # a launched copy of the script ends after serving
                if stage != "fit":  # validation before the fit samples on the trainer ranks: nothing to serve
                    return None
                launched = os.environ.get(failure.LAUNCHER_PID_ENV, str(os.getpid())) != str(os.getpid())
                mirrors = {kind: handler for cb in self.callbacks
                           for kind, handler in getattr(cb, "rollout_rank_mirrors", dict)().items()}
                return pool.serve(exit_process=launched, mirrors=mirrors)
            self.world = pool.world if pool is not None else self.world
            try:
                return self._run_stage(stage, module, datamodule, ckpt_path)
            finally:
                if pool is not None and stage == "fit":  # the pool serves one fit (a stage before it: kept)
                    pool.close()

    def _run_stage(self, stage: str, module: TrainingModule, datamodule: Any, ckpt_path: CkptPath) -> Any:
        """Set up ``stage`` on this rank (module, engines, data, checkpoint) and run its loop."""
        progress = self.progress
        progress.stage, progress.should_stop, progress.train_loader = stage, False, None
        self.module, self.datamodule = module, datamodule  # Lightning's; the data's fingerprint is saved
        module.trainer = self
        if datamodule is not None and hasattr(datamodule, "trainer"):
            datamodule.trainer = self  # Lightning's attribute: the datamodule reads trainer.dp_size
        self.step_hooks = self.callback_step_hooks()  # the callbacks may have changed since construction
        _seed_everything(self.seed)
        _apply_deterministic(self.deterministic)
        self.logging.setup(self.is_global_zero, getattr(module, "hparams", None))  # fit logs the same
        status = "failed"
        try:
            if stage == "fit" and datamodule is not None and callable(getattr(module, "check_data", None)):
                module.check_data(datamodule)  # settings only: every rank raises alike, before any model
            self.call_hook("setup", stage)
            module.setup(stage)
            resume = self._check_resume(ckpt_path) if ckpt_path is not None else None  # before any engine
            self._configure_engines(module)
            result = self._run_loop(stage, module, datamodule, ckpt_path, resume)
            status = "success"
            return result
        except BaseException as exc:
            self.call_hook("on_exception", exc)
            raise
        finally:
            self.call_hook("teardown", stage)
            self.logging.finalize(status)
            if status == "success":
                barrier()
            progress.stage = None

    def _run_loop(self, stage: str, module: TrainingModule, datamodule: Any, ckpt_path: CkptPath,
                  resume: tuple[Path, dict[str, Any]] | None) -> Any:
        """Shard the stage's data, restore ``ckpt_path``, build the stage's loop and run it."""
        fit, has_val, evaluates = stage == "fit", stage in ("fit", "validate"), stage in EVAL_STAGES

        def loader(kind: str, direct: bool) -> ShardedLoader | None:
            return stage_loader(kind, datamodule, module, direct, self.dp_rank, self.dp_size, self.seed,
                                self.limits[kind])

        self.progress.train_loader = loader("train", direct=True) if fit else None
        self.val_loader = loader("val", direct=not fit) if has_val else None
        self.eval_loader = loader(stage, direct=True) if evaluates else None
        if fit and self.train_loader is None:
            raise ValueError("fit needs training data: pass a datamodule or define module.train_dataloader()")
        if ckpt_path is not None:
            self._restore(ckpt_path, resume)
        evaluation = EvaluationLoop(module, self.progress, self.call_hook, self.logging, self.flush_metrics,
                                    self.metric_group, self.val_loader, self.eval_loader,
                                    self.num_sanity_val_steps)
        if stage == "validate":
            return [evaluation.validate()]
        if not fit:
            return evaluation.run_stage(stage)
        limits = FitLimits(
            self.max_steps, self.max_epochs, self.min_steps, self.min_epochs, self.max_time,
            self.accumulate_grad_batches, self.val_check_interval, self.check_val_every_n_epoch,
            self.limits["train"],
        )
        self.fit_loop = FitLoop(module, self.progress, limits, self.call_hook, self.logging, evaluation,
                                self.metric_group, self.callbacks, self.is_global_zero, self.dp_rank)
        return self.fit_loop.run()

    def _configure_engines(self, module: TrainingModule) -> None:
        """Build and initialise the module's engines with the strategy (on its one topology), once per module.

        The module gets the run's topology with them (``module.topology``); ``gradient_clip_val`` overrides
        every spec's ``OptimConfig.clip_grad``.
        """
        if not module.engines:
            specs = dict(module.configure_engines())
            if self.gradient_clip_val is not None:
                clip = self.gradient_clip_val
                specs = {name: dataclasses.replace(spec, optim=spec.optim.replace(clip_grad=clip))
                         if isinstance(spec, EngineSpec) and spec.optim is not None else spec
                         for name, spec in specs.items()}
            module.engines = self.strategy.build_engines(specs, self.precision, self.seed, self.accelerator)
        module.topology = self.strategy.topology or module.topology

    def peek_next_batch(self) -> Any | None:
        """This rank's batch of the next training step, read ahead without consuming it (``None``: unknown).

        See :meth:`verl_trainer.training.fit_loop.FitLoop.peek_next_batch`; ``None`` outside ``fit``.
        """
        return self.fit_loop.peek_next_batch() if self.fit_loop is not None and self.state == "fit" else None

    def peek_next_batches(self, count: int) -> list[Any]:
        """This rank's batches of up to ``count`` next training steps, read ahead (empty outside ``fit``).

        See :meth:`verl_trainer.training.fit_loop.FitLoop.peek_next_batches`.
        """
        fitting = self.fit_loop is not None and self.state == "fit"
        return self.fit_loop.peek_next_batches(count) if fitting else []

    # ------------------------------------------------------------------------------------- checkpoints
    @property
    def checkpoint_dir(self) -> Path:
        """Where checkpoints are written and ``"last"`` is looked up."""
        cb = self.checkpoint_callback
        if cb is not None and cb.dirpath is not None:
            return Path(cb.dirpath)
        return Path(self.default_root_dir) / "checkpoints"

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Save everything needed to continue exactly (a collective: call it on every rank).

        See ``training/checkpoint.py`` for the directory; ``meta.json`` records what a resume is checked
        against (``training/resume_check.py``).
        """
        self.flush_metrics()
        self.logging.save()
        meta = {
            "global_step": self.global_step,
            "run_id": getattr(self.checkpoint_callback, "run_id", None),
            **resume_check.run_metadata(self),
        }
        checkpoint.save_run(Path(path), self.progress, self.module, self.callbacks, self.call_hook, meta)

    def _check_resume(self, ckpt_path: str | os.PathLike) -> tuple[Path, dict[str, Any]] | None:
        """Find ``ckpt_path``'s checkpoint and check this run against it (:func:`checkpoint.check_resume`).

        The differences that apply are printed on rank 0 and kept in ``resume_changes``.
        """
        found = checkpoint.check_resume(ckpt_path, self.checkpoint_dir, self)
        if found is None:
            return None
        path, meta, self.resume_changes = found
        if self.resume_changes and self.is_global_zero:
            listed = "\n  ".join(self.resume_changes)
            print(f"resuming from {path}; changed since the checkpoint (these apply):\n  {listed}",
                  flush=True)
        return path, meta

    def _restore(self, ckpt_path: str | os.PathLike, resume: tuple[Path, dict[str, Any]] | None) -> None:
        """Restore the checkpoint :meth:`_check_resume` found (``None``: ``"last"`` found none; warn)."""
        if resume is None:
            if self.is_global_zero:
                warnings.warn(
                    f"ckpt_path='last' found no complete checkpoint in {str(self.checkpoint_dir)!r}; "
                    f"starting from scratch", stacklevel=2,
                )
            return
        path, meta = resume
        resume_check.check_models(path, meta, self.module.engines)
        checkpoint.restore_run(path, self.progress, self.module, self.callbacks, self.call_hook)


def _seed_everything(seed: int) -> None:
    """Seed Python, numpy and torch (CPU and CUDA) identically on every rank."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _apply_deterministic(setting: bool | str) -> None:
    """``Trainer(deterministic=)``: deterministic torch kernels (``"warn"``: warn where there are none)."""
    if setting:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=setting == "warn")

