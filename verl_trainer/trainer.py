"""The Trainer: Lightning's arguments and loop shape, verl's engines underneath, SPMD on every rank.

::

    trainer = Trainer(strategy="fsdp2", devices=2, max_steps=50, logger="wandb",
                      callbacks=[ModelCheckpoint(every_n_train_steps=10)])
    trainer.fit(SFT(config), datamodule=data, ckpt_path="last")

Every rank runs the Trainer. ``fit`` starts or joins the process world (``verl_trainer.training.launch``),
builds the module's engines with the strategy, shards the data by data-parallel rank
(``verl_trainer.training.data``), restores a checkpoint, and runs the loop (``verl_trainer.training.loops``)
with hooks dispatched by :meth:`Trainer.call_hook`. Invalid arguments fail here, at construction.

Callback order is fixed: ``MetricReduction`` first (its group is where the loops reduce the module's
step outputs into logged values, before any callback sees them), then the user's callbacks in the given
order (the default ``ProgressBar`` after them), and ``ModelCheckpoint`` callbacks last, as in Lightning.
Metrics of a step are logged on rank 0 after ``on_train_batch_end`` (every ``log_every_n_steps``), or
earlier when a checkpoint is saved, so a checkpoint never precedes its own step in the logs.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from verl_trainer.callbacks import Callback, MetricReduction, ModelCheckpoint, ProgressBar
from verl_trainer.callbacks.base import HOOK_NAMES, check_callback
from verl_trainer.engine.config import EngineSpec
from verl_trainer.engine.hooks import STEP_HOOK_NAMES, StepHooks
from verl_trainer.engine.lora_files import check_adapters
from verl_trainer.metrics import Metric
from verl_trainer.module import TrainingModule
from verl_trainer.training import failure, launch, loops
from verl_trainer.training.args import (
    TrainerArgs,
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
from verl_trainer.training.data import ShardedLoader, refuse_raw_rows
from verl_trainer.training.lightning_args import (
    check_accumulate,
    check_gradient_clip,
    check_limit,
    check_optional_count,
    check_val_check_interval,
    parse_max_time,
    reject_unknown_args,
)
from verl_trainer.training.lightning_module import LightningAttributes, check_lightning_habits
from verl_trainer.training.loggers import validate_logger_spec
from verl_trainer.training.logging import MetricLogging
from verl_trainer.training.stage_data import fit_data, stage_data
from verl_trainer.training.strategy import Strategy, check_precision, normalize_precision, resolve_strategy
from verl_trainer.utils.distributed import is_initialized

__all__ = ["Trainer"]

_DEFAULTS = TrainerArgs()  # the one source of the defaults (the recipes' TrainerConfig extends it)
_CHAINED_HOOKS = frozenset({"on_before_update"})


def _as_callback_list(callbacks: Sequence[Callback] | Callback | None) -> list[Callback]:
    if callbacks is None:
        return []
    if isinstance(callbacks, Sequence) and not isinstance(callbacks, str):
        return list(callbacks)
    return [callbacks]


def _listens(callback: Callback, hook: str) -> bool:
    """Whether ``callback`` implements ``hook``: what it answers for the name is not the base no-op."""
    return getattr(getattr(callback, hook), "__func__", None) is not getattr(Callback, hook)


def _is_interactive() -> bool:
    import __main__

    return not hasattr(__main__, "__file__") and __main__.__spec__ is None


class Trainer(LightningAttributes):
    """Fits a :class:`~verl_trainer.module.TrainingModule` with a strategy's engines.

    Args:
        strategy: An engine backend registered with ``EngineRegistry`` (``"fsdp2"``, ``"fsdp"``,
            ``"deepspeed"``, ``"deepspeed_stage_3"``, ...) or a
            :class:`~verl_trainer.training.strategy.Strategy`.
        accelerator: ``"auto"``, ``"cpu"``, ``"gpu"`` / ``"cuda"``.
        devices: Processes per node (an int or ``"auto"``).
        num_nodes: Number of nodes.
        precision: ``"32-true"``, ``"bf16-mixed"`` or ``"bf16-true"`` (``32`` / ``"bf16"`` accepted).
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
        logger: Any = _DEFAULTS.logger,
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
        self.strategy = resolve_strategy(strategy)
        if collective_timeout is not None:
            self.strategy.timeout = check_collective_timeout(collective_timeout, self.strategy.timeout)
        self.accelerator = resolve_accelerator(accelerator)
        self.devices = resolve_devices(devices, self.accelerator)
        self.num_nodes = check_num_nodes(num_nodes)
        self.precision = check_precision(normalize_precision(precision), self.accelerator,
                                         self.strategy.backend)
        self.max_steps, self.max_epochs = check_run_length(max_steps, max_epochs)
        self.log_every_n_steps = check_log_every_n_steps(log_every_n_steps)
        self.val_check_interval = check_val_check_interval(val_check_interval)
        self.check_val_every_n_epoch = check_optional_count(
            "check_val_every_n_epoch", check_val_every_n_epoch, 1
        )
        self.accumulate_grad_batches = check_accumulate(accumulate_grad_batches)
        self.gradient_clip_val = check_gradient_clip(gradient_clip_val, gradient_clip_algorithm)
        self.gradient_clip_algorithm = "norm"
        self.limits = {kind: check_limit(f"limit_{kind}_batches", value) for kind, value in (
            ("train", limit_train_batches), ("val", limit_val_batches), ("test", limit_test_batches),
            ("predict", limit_predict_batches))}
        self.max_time = parse_max_time(max_time)
        self.min_steps = check_optional_count("min_steps", min_steps)
        self.min_epochs = check_optional_count("min_epochs", min_epochs)
        self.num_sanity_val_steps = check_optional_count("num_sanity_val_steps", num_sanity_val_steps, -1)
        self.deterministic = check_deterministic(deterministic)
        self.fast_dev_run = check_fast_dev_run(fast_dev_run)
        if self.fast_dev_run:  # Lightning's meaning: N train and N val batches, one epoch, nothing written
            n = self.fast_dev_run
            self.max_steps, self.max_epochs, self.max_time = n, 1, None
            self.limits.update(train=n, val=n, test=n, predict=n)
            self.val_check_interval, self.check_val_every_n_epoch, self.num_sanity_val_steps = None, 1, 0
            logger, enable_checkpointing = False, False
            callbacks = [cb for cb in _as_callback_list(callbacks) if not isinstance(cb, ModelCheckpoint)]
        self.seed = check_seed(seed)
        validate_logger_spec(logger)
        self.default_root_dir = os.fspath(Path(default_root_dir or os.getcwd()).absolute())
        self.logging = MetricLogging(logger, self.default_root_dir, log_every_n_steps)
        self.callbacks = self._order_callbacks(callbacks, enable_progress_bar, enable_checkpointing)
        self._env = launch.select_cluster_environment()
        self._env.validate_settings(num_devices=self.devices, num_nodes=self.num_nodes)
        self._check_launchable()
        # run state
        self.world: launch.World | None = None
        self.module: TrainingModule | None = None
        self.datamodule: Any = None  # set by fit / validate / test / predict (Lightning's attribute)
        self.state: str | None = None
        self.global_step = 0
        self.should_stop = False
        self.resume_changes: list[str] = []  # what changed since the checkpoint a fit resumed from (applied)
        self.train_loader: ShardedLoader | None = None
        self.val_loader: ShardedLoader | None = None
        self.eval_loader: ShardedLoader | None = None  # test / predict data
        self.sanity_checking = False
        self.evaluating = False  # inside a validation / test / predict loop
        self.step_hooks = self.callback_step_hooks()

    # ----------------------------------------------------------------------------------- validation
    @staticmethod
    def _order_callbacks(
        callbacks: Sequence[Callback] | Callback | None, progress_bar: bool, checkpointing: bool
    ) -> list[Callback]:
        given = _as_callback_list(callbacks)
        for cb in given:
            check_callback(cb)
        if any(isinstance(cb, ProgressBar) for cb in given) and not progress_bar:
            raise ValueError("a ProgressBar is in callbacks but enable_progress_bar=False; drop one of them")
        if any(isinstance(cb, ModelCheckpoint) for cb in given) and not checkpointing:
            raise ValueError(
                "a ModelCheckpoint is in callbacks but enable_checkpointing=False; drop one of them"
            )
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

    def _check_launchable(self) -> None:
        world = self.devices * self.num_nodes
        if world > 1 and not self._env.creates_processes_externally and not is_initialized():
            if _is_interactive():
                raise ValueError(
                    f"devices={self.devices} x num_nodes={self.num_nodes} needs several processes, which are "
                    f"started by re-running the script: run it as `python script.py` (or torchrun), not "
                    f"from an interactive session"
                )
            if self.num_nodes > 1:
                raise ValueError(
                    "num_nodes > 1 needs a cluster launcher (torchrun, SLURM's srun, ...) that starts the "
                    "processes on every node; with a plain `python script.py` use num_nodes=1"
                )

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
        topo = self.strategy.topology
        return topo.dp_group if topo is not None else None

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel rank (the global rank before the topology exists)."""
        topo = self.strategy.topology
        return topo.dp_rank if topo is not None else self.global_rank

    @property
    def dp_size(self) -> int:
        """The data-parallel size (the world size before the topology exists)."""
        topo = self.strategy.topology
        return topo.dp_size if topo is not None else self.world_size

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
        """Dispatch ``on_before_update`` and return the (possibly replaced) batch."""
        return self.call_hook("on_before_update", batch)

    # -------------------------------------------------------------------------------------- logging
    @property
    def loggers(self) -> list[Any]:
        """The loggers (built on rank 0 at fit; empty on the other ranks)."""
        return self.logging.loggers

    @property
    def logger(self) -> Any:
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
    def fit(self, module: Any, train_dataloaders: Any = None, val_dataloaders: Any = None,
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
        """Whether ``fit`` validates after the current step.

        An int ``val_check_interval``: every N trainer steps. A float: every ``max(1, int(f * B))`` loader
        batches of an epoch of ``B`` (after ``limit_train_batches``), in the epochs
        ``check_val_every_n_epoch`` selects. No interval but ``check_val_every_n_epoch=N`` (or
        ``fast_dev_run``): at the end of every N-th epoch.
        """
        loader = self.train_loader
        if self.state != "fit" or self.val_loader is None or self.sanity_checking or loader is None:
            return False
        interval, every_epoch = self.val_check_interval, self.check_val_every_n_epoch
        if isinstance(interval, int):
            return self.global_step % interval == 0
        total = loader.limited_len() if interval is not None else 0
        if every_epoch is not None and (loader.epoch + 1) % every_epoch:
            return False
        if interval is None:
            return every_epoch is not None and loader.exhausted()
        if total is None:
            raise ValueError(
                f"val_check_interval={interval} is a fraction of an epoch, but the training data is a stream "
                "of unknown length; use an int val_check_interval (trainer steps) or limit_train_batches=N"
            )
        every = max(1, int(interval * total)) if total else 1
        done = loader.batches
        crossed = done // every > (done - self.accumulate_grad_batches) // every  # one step may cross it
        return loader.exhausted() or crossed

    def validate(self, module: Any, dataloaders: Any = None, ckpt_path: str | os.PathLike | None = None,
                 verbose: bool = True, datamodule: Any = None) -> list[dict[str, float]]:
        """Run the validation data once; returns ``[metrics]`` (reduced over batches and ranks).

        ``dataloaders`` (a DataLoader / Dataset, or a datamodule) or ``datamodule``: Lightning's arguments,
        in its order; ``verbose`` is accepted (nothing is printed either way).
        """
        self._check_module(module)
        return self._launch("validate", module, stage_data("validate", dataloaders, datamodule), ckpt_path)

    def test(self, module: Any, dataloaders: Any = None, ckpt_path: str | os.PathLike | None = None,
             verbose: bool = True, datamodule: Any = None) -> list[dict[str, float]]:
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

    def predict(self, module: Any, dataloaders: Any = None, datamodule: Any = None,
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

    def check(self, module: Any, datamodule: Any = None) -> int:
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
        specs = module.configure_engines()
        self.strategy.check_mesh_sizes(specs, self.precision, self.seed)  # one (dp, sp | tp) mesh for all
        configs = [self.strategy.engine_config(spec.config, self.precision, self.seed)
                   for spec in specs.values() if isinstance(spec, EngineSpec)]
        dp_size = configs[0].dp_size(self.world_size) if configs else self.world_size
        check_adapters(specs)
        if datamodule is not None and callable(getattr(datamodule, "check", None)):
            datamodule.check(dp_size)
        return dp_size

    @staticmethod
    def _check_module(module: Any) -> None:
        for name in ("configure_engines", "training_step"):
            if not callable(getattr(module, name, None)):
                raise TypeError(
                    f"{type(module).__name__} is not a training module: it has no {name}(); subclass "
                    f"verl_trainer.module.TrainingModule"
                )
        check_lightning_habits(module)

    def _launch(self, stage: str, module: Any, datamodule: Any, ckpt_path: Any) -> Any:
        launcher = launch.launcher_for(self._env, self.devices, self.num_nodes)
        return launcher.launch(self._run_guarded, stage, module, datamodule, ckpt_path)

    def _run_guarded(self, stage: str, module: Any, datamodule: Any, ckpt_path: Any) -> Any:
        with failure.guard():
            self.world = launch.connect(
                self._env, self.devices, self.num_nodes,
                self.strategy.dist_backend(self.accelerator), self.strategy.timeout,
            )
            if self.accelerator == "cpu":
                os.environ.setdefault("VERL_ENGINE_DEVICE", "cpu")
            return loops.run_stage(self, stage, module, datamodule, ckpt_path)

    def peek_next_batch(self) -> Any | None:
        """This rank's batch of the next training step, read ahead without consuming it (``None``: unknown).

        See :func:`verl_trainer.training.loops.peek_next_step_batch`.
        """
        return loops.peek_next_step_batch(self)

    # ------------------------------------------------------------------------------------- checkpoints
    @property
    def checkpoint_dir(self) -> Path:
        """Where checkpoints are written and ``"last"`` is looked up."""
        cb = self.checkpoint_callback
        if cb is not None and cb.dirpath is not None:
            return Path(cb.dirpath)
        return Path(self.default_root_dir) / "checkpoints"

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Save everything needed to continue exactly (a collective: call it on every rank)."""
        loops.save_checkpoint(self, Path(path))

