"""The module interface that SFT, PPO and GRPO implement for :class:`verl_trainer.Trainer`.

A :class:`TrainingModule` names its engines, says what one training step does, and holds the plain state it
needs across steps; the Trainer does the rest. Every rank runs the same module (SPMD). ::

    class MySFT(TrainingModule):
        def configure_engines(self):                      # called once the process group exists
            return {"actor": EngineSpec("language_model", EngineConfig(model_path=...), OptimConfig())}

        def training_step(self, batch, batch_idx):         # one trainer step on this rank's shard
            batch = self.trainer.call_hook("on_before_update", batch)  # RL: after rollout/rewards/advantages
            actor = self.engines["actor"]
            with actor.train_mode():
                out = actor.train_batch(batch, self.loss_fn, hooks=self.step_hooks)
            return {"train/loss": out["loss"], "train/grad_norm": out["grad_norm"],
                    "micro_batches": out["metrics"]}

Required: :meth:`~TrainingModule.configure_engines`, :meth:`~TrainingModule.training_step`. Optional:
``validation_step``, ``test_step``, ``predict_step``, ``setup``, ``state_dict`` / ``load_state_dict`` (plain
data: saved with ``torch.save``, loaded with ``weights_only=True``), ``hparams`` (logged once),
``train_dataloader()`` / ``val_dataloader()`` when ``fit`` gets no datamodule.

**Step outputs** (``training_step`` / ``validation_step`` return a mapping, reduced over micro-batches and
ranks before anything is logged):

* a :class:`~verl_trainer.metrics.Metric` — reduced as it declares (SUM / MEAN / MIN / MAX);
* a plain number or 0-d tensor — a MEAN over ranks (for values equal on every rank: the engine's global
  ``loss``, ``grad_norm``, ``lr``);
* a list of per-micro-batch ``{name: Metric}`` dicts (``engine.train_batch(...)["metrics"]``) — merged in
  under their own names (the key is not used);
* anything else is passed to ``on_train_batch_end`` but not logged.

**Hooks a step may dispatch** (``self.trainer.call_hook``): ``on_rollout_end(batch)`` after rollout and
rewards; ``batch = on_before_update(batch)`` before the engine update (a callback may return a
re-partitioned batch); ``engine.train_batch(..., hooks=self.step_hooks)`` dispatches the optimizer-step
hooks. The Trainer steps every engine's LR scheduler once after each ``training_step``.

**Declared contract** (what callbacks may ask a module): :attr:`TrainingModule.actor`,
:attr:`TrainingModule.hidden_size`, :attr:`TrainingModule.required_batch_multiple`. User guide:
docs/lightning.md, "Modules".
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch

from verl_trainer.engine.config import EngineSpec
from verl_trainer.engine.hooks import StepHooks
from verl_trainer.metrics import Metric

if TYPE_CHECKING:
    import torch.distributed as dist

    from verl_trainer.callbacks.progress import ProgressBar
    from verl_trainer.engine.base import BaseEngine
    from verl_trainer.engine.topology import Topology

__all__ = ["EngineSpec", "ModuleTrainer", "StepOutput", "TrainingModule"]

LOG_REDUCTIONS = ("mean", "sum", "min", "max")
"""What :meth:`TrainingModule.log` may reduce with (``Metric``'s reductions)."""

_REDUCE_FX: dict[str | Callable[..., object], str] = {
    **{r: r for r in LOG_REDUCTIONS}, torch.mean: "mean", torch.sum: "sum", torch.min: "min",
    torch.max: "max"}
"""Lightning's ``reduce_fx`` values → ``reduce``."""

StepOutput = Mapping[str, Any]
"""What ``training_step`` / ``validation_step`` return (see the module docstring)."""


class ModuleTrainer(Protocol):
    """What a module may use of the Trainer running it (``self.trainer``; :class:`verl_trainer.Trainer`).

    The module depends on this, not on the Trainer class, so neither imports the other.
    """

    @property
    def global_step(self) -> int:
        """Optimizer steps done."""

    @property
    def current_epoch(self) -> int:
        """The training epoch (0-based)."""

    @property
    def is_global_zero(self) -> bool:
        """True on global rank 0."""

    @property
    def dp_size(self) -> int:
        """The data-parallel size."""

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The data-parallel group (``None``: the whole world)."""

    @property
    def evaluating(self) -> bool:
        """Inside a validation / test / predict loop."""

    @property
    def progress_bar_callback(self) -> ProgressBar | None:
        """The ``ProgressBar`` callback, if any (its ``metrics`` tuple names what it shows)."""

    step_hooks: StepHooks
    """The engine's optimizer-step hooks dispatching to the callbacks."""

    default_root_dir: str
    """Where logs, checkpoints and generations go."""

    def log_metrics(self, metrics: Mapping[str, Metric | float]) -> None:
        """Add values to the current step's metrics, each with its reduction."""

    def call_hook(self, hook: str, *args: Any) -> Any:
        """Dispatch a callback hook (``on_before_update`` returns the possibly replaced batch)."""

    def call_before_update(self, batch: Any) -> Any:
        """Dispatch ``on_before_update``; returns the (possibly replaced) batch."""

    def peek_next_batch(self) -> Any | None:
        """This rank's batch of the next training step, read ahead (``None``: unknown)."""

    def peek_next_batches(self, count: int) -> list[Any]:
        """This rank's batches of up to ``count`` next training steps, read ahead (fewer where unknown)."""


class TrainingModule:
    """Base class of what ``Trainer.fit`` trains (see the module docstring for the contract).

    Attributes:
        trainer: The Trainer running this module (set by ``fit`` / ``validate``), as
            :class:`ModuleTrainer`.
        engines: The initialised engines, by the names :meth:`configure_engines` returned.
        topology: The run's process topology (``dp_group``, ``dp_rank``, ``dp_size``, ...), set with the
            engines; ``None`` before.
    """

    def __init__(self) -> None:
        self.trainer: ModuleTrainer | None = None
        self.engines: dict[str, BaseEngine] = {}
        self.topology: Topology | None = None

    @property
    def hparams(self) -> dict[str, Any]:
        """Hyperparameters logged once per run: a dataclass ``self.config`` as plain data, else ``{}``.

        Override to report something else.
        """
        config = getattr(self, "config", None)
        if dataclasses.is_dataclass(config) and not isinstance(config, type):
            return dataclasses.asdict(config)
        return {}

    def setup(self, stage: str) -> None:
        """Called on every rank at the start of ``fit`` / ``validate`` (``stage``), before the engines."""

    def check_data(self, datamodule: Any) -> None:
        """Check this module's settings against ``datamodule``'s before any model loads; default: nothing.

        Called by :meth:`Trainer.check <verl_trainer.Trainer.check>` (in the launching process) and at the
        start of ``fit`` on every rank, before :meth:`setup`: it must depend on the settings only, so every
        rank raises alike.

        Raises:
            ValueError: A combination of settings that cannot run, naming both and the fix.
        """

    def training_world_size(self, world_size: int) -> int:
        """How many of a ``world_size``-process run's processes train; default: all of them.

        A module whose settings give some processes another role (an RL module's separate rollout pool)
        returns fewer. :meth:`Trainer.check <verl_trainer.Trainer.check>` sizes data parallelism (batch
        divisibility, the steps of an epoch) from it; it must depend on the settings only.

        Raises:
            ValueError: ``world_size`` cannot be split as the settings ask, naming the setting and the fix.
        """
        return world_size

    def configure_engines(self) -> Mapping[str, EngineSpec | BaseEngine]:
        """Name the engines of this module, in a fixed order (the same on every rank).

        Called once the process group exists. Return :class:`EngineSpec` values (the Trainer builds them
        with its strategy) or engines built with ``self.trainer.strategy.build_engine``; the Trainer
        initialises them and stores them in :attr:`engines`. The first engine is the actor: its data
        parallel group shards the data.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement configure_engines()")

    def training_step(self, batch: Any, batch_idx: int) -> StepOutput:
        """One trainer step on this rank's batch; returns step outputs (see the module docstring)."""
        raise NotImplementedError(f"{type(self).__name__} must implement training_step(batch, batch_idx)")

    def validation_step(self, batch: Any, batch_idx: int) -> StepOutput | None:
        """One validation batch; the outputs of all batches are reduced together."""
        raise NotImplementedError(
            f"{type(self).__name__} has validation data but no validation_step(batch, batch_idx)"
        )

    def test_step(self, batch: Any, batch_idx: int) -> StepOutput | None:
        """One test batch (``Trainer.test``); the outputs of all batches are reduced together."""
        raise NotImplementedError(
            f"{type(self).__name__} has no test_step(batch, batch_idx) for Trainer.test"
        )

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        """One predict batch (``Trainer.predict``); returns anything (collected per batch, not reduced)."""
        raise NotImplementedError(
            f"{type(self).__name__} has no predict_step(batch, batch_idx) for Trainer.predict"
        )

    def log(self, name: str, value: torch.Tensor | float, reduce: str = "mean",
            weight: torch.Tensor | float | None = None, *, prog_bar: bool = False,
            on_step: bool | None = None, on_epoch: bool | None = None, sync_dist: bool | None = None,
            reduce_fx: str | Callable[..., object] | None = None,
            batch_size: int | None = None, logger: bool | None = None) -> None:
        """Log ``value`` under ``name`` (this step or evaluation), reduced over micro-batches and ranks.

        Args:
            name: The metric name.
            value: A number or a tensor (a tensor of several elements is reduced as its elements).
            reduce: ``"mean"`` (optionally weighted by ``weight``), ``"sum"`` (over the step's calls and the
                data-parallel ranks, as Lightning's ``reduce_fx="sum"``; ranks of one SP group log the same
                value), ``"min"`` or ``"max"``.
            weight: Weight of a ``"mean"`` value (e.g. its token count).
            prog_bar: Lightning's: also show the value on the progress bar.
            on_step: Lightning's; values logged in ``training_step`` are per step, in validation / test
                steps per run (Lightning's defaults there): ``None`` or that value, else an error.
            on_epoch: Likewise (``True`` only in validation / test steps).
            sync_dist: Lightning's; accepted: values are always reduced over the ranks.
            reduce_fx: Lightning's name of ``reduce`` (``"mean"``, ``"sum"``, ``"min"``, ``"max"`` or
                ``torch.mean`` / ``torch.sum`` / ``torch.min`` / ``torch.max``).
            batch_size: Lightning's: the weight of a ``"mean"`` value.
            logger: Lightning's; ``None`` / ``True`` (every logged value goes to the loggers).

        Raises:
            ValueError: An unknown ``reduce``, or a Lightning option this Trainer does not do, with the fix.
            RuntimeError: Outside ``fit`` / ``validate`` / ``test`` (no Trainer).
        """
        reduce, weight = self._lightning_log_options(name, reduce, weight, on_step, on_epoch, reduce_fx,
                                                     batch_size, logger)
        if reduce not in LOG_REDUCTIONS:
            raise ValueError(f"self.log({name!r}, reduce={reduce!r}); choose one of {LOG_REDUCTIONS}")
        if weight is not None and reduce != "mean":
            raise ValueError(f"self.log({name!r}, weight=...) needs reduce='mean', got reduce={reduce!r}")
        if self.trainer is None:
            raise RuntimeError(f"self.log({name!r}) outside a Trainer run: call it from the module's steps")
        value = value.detach() if isinstance(value, torch.Tensor) else value
        if reduce == "sum":  # Lightning's sum: over calls and data-parallel ranks (Metric.sum averages ranks)
            metric = Metric.sum(value * self.trainer.dp_size)
        else:
            metric = Metric.mean(value, weight) if reduce == "mean" else getattr(Metric, reduce)(value)
        self.trainer.log_metrics({name: metric})
        bar = self.trainer.progress_bar_callback
        if prog_bar and bar is not None and name not in bar.metrics:
            bar.metrics = (*bar.metrics, name)

    def _lightning_log_options(self, name: str, reduce: str, weight: torch.Tensor | float | None,
                               on_step: bool | None, on_epoch: bool | None,
                               reduce_fx: str | Callable[..., object] | None, batch_size: int | None,
                               logger: bool | None) -> tuple[str, torch.Tensor | float | None]:
        """``reduce`` and ``weight`` with Lightning's ``self.log`` options applied (or refused)."""
        if reduce_fx is not None:
            fx = _REDUCE_FX.get(reduce_fx) if isinstance(reduce_fx, str) or callable(reduce_fx) else None
            if fx is None or (reduce != "mean" and reduce != fx):
                raise ValueError(f"self.log({name!r}, reduce_fx={reduce_fx!r}): use one of 'mean', 'sum', "
                                 "'min', 'max' (or torch.mean / sum / min / max), not a different reduce=")
            reduce = fx
        if batch_size is not None and weight is None and reduce == "mean":
            weight = float(batch_size)
        if logger is False:
            raise ValueError(f"self.log({name!r}, logger=False): every value logged here goes to the "
                             "loggers; keep it in a local variable instead (or drop logger=False)")
        evaluating = bool(getattr(self.trainer, "evaluating", False))
        want_step, want_epoch = (False, True) if evaluating else (True, False)
        where = "validation / test steps (reduced over the run)" if evaluating else "training_step (per step)"
        for option, given, wanted in (("on_step", on_step, want_step), ("on_epoch", on_epoch, want_epoch)):
            if given is not None and given != wanted:
                raise ValueError(
                    f"self.log({name!r}, {option}={given}): values logged in {where} are logged with "
                    f"on_step={want_step}, on_epoch={want_epoch} here (Lightning's defaults there); drop "
                    f"{option}= or log an epoch value from a Callback's on_train_epoch_end with "
                    "trainer.log_metrics"
                )
        return reduce, weight

    def log_dict(self, metrics: Mapping[str, torch.Tensor | float], reduce: str = "mean",
                 **options: Any) -> None:
        """:meth:`log` every item of ``metrics`` with one ``reduce`` (and :meth:`log`'s Lightning options)."""
        for name, value in metrics.items():
            self.log(name, value, reduce=reduce, **options)

    # ---------------------------------------------------------------- Lightning's module attributes
    @property
    def global_step(self) -> int:
        """The Trainer's optimizer steps so far (0 outside a run)."""
        return self.trainer.global_step if self.trainer is not None else 0

    @property
    def current_epoch(self) -> int:
        """The training epoch the fit is in (0-based; 0 outside a run)."""
        return self.trainer.current_epoch if self.trainer is not None else 0

    @property
    def device(self) -> torch.device:
        """The device the actor engine computes on (CPU before the engines are built)."""
        return self.actor.device if self.engines else torch.device("cpu")

    def state_dict(self) -> dict[str, Any]:
        """Non-engine state to checkpoint (plain data and tensors); engines are saved separately."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    # -------------------------------------------------------------------------- declared contract
    @property
    def actor(self) -> BaseEngine:
        """The first engine (the actor): its model and data-parallel layout describe the run.

        Raises:
            RuntimeError: The engines are not built yet (before ``fit`` configured them).
        """
        if not self.engines:
            raise RuntimeError(f"{type(self).__name__} has no engines yet; they are built at fit/validate")
        return next(iter(self.engines.values()))

    def save_hf(self, path: str | os.PathLike, **kwargs: Any) -> str:
        """The trained policy as an HF directory: ``self.actor.save_hf(path, **kwargs)`` (a collective).

        After ``trainer.fit(module)``, on every rank: ``module.save_hf("out/hf")``; see
        :meth:`BaseEngine.save_hf <verl_trainer.engine.base.BaseEngine.save_hf>` for ``kwargs``.
        """
        return self.actor.save_hf(path, **kwargs)

    @property
    def hidden_size(self) -> int:
        """The actor model's hidden size (from its HF config), e.g. for the balancing workload model."""
        config = self.actor.model_config
        size = getattr(config, "hidden_size", None)
        if not isinstance(size, int):
            raise RuntimeError(
                f"the actor's model config has no integer hidden_size ({type(config).__name__}); pass "
                "hidden_size to the callback that asked for it"
            )
        return size

    @property
    def required_batch_multiple(self) -> int:
        """The multiple (in samples) the global update batch must have; RL modules: lcm(dp, mini × n)."""
        return 1

    @property
    def step_hooks(self) -> StepHooks | None:
        """The hooks to pass to ``engine.train_batch(..., hooks=)``: the Trainer's callback dispatch."""
        return self.trainer.step_hooks if self.trainer is not None else None
