"""The module interface that SFT, PPO and GRPO implement for :class:`verl_trainer.Trainer`.

A :class:`TrainingModule` is small: it names its engines, says what one training step does, and holds
whatever plain state it needs across steps. The Trainer does the rest (processes, engines' setup,
data sharding, hooks, metric reduction, logging, checkpoints). Every rank runs the same module (SPMD).

What to implement::

    class MySFT(TrainingModule):
        def configure_engines(self):                      # called once the process group exists
            return {"actor": EngineSpec("language_model", EngineConfig(model_path=...), OptimConfig())}

        def training_step(self, batch, batch_idx):         # one trainer step on this rank's shard
            batch = self.trainer.call_before_update(batch)  # RL: after rollout/rewards/advantages
            actor = self.engines["actor"]
            with actor.train_mode():
                out = self.engine_step(actor, batch, self.loss_fn)
            return {"train/loss": out["loss"], "train/grad_norm": out["grad_norm"],
                    "micro_batches": out["metrics"]}

Required: :meth:`~TrainingModule.configure_engines`, :meth:`~TrainingModule.training_step`.
Optional: :meth:`~TrainingModule.validation_step`, :meth:`~TrainingModule.setup`,
:meth:`~TrainingModule.state_dict` / :meth:`~TrainingModule.load_state_dict` (plain data: it is saved
with ``torch.save`` and loaded with ``weights_only=True``), :attr:`~TrainingModule.hparams` (logged once),
``train_dataloader()`` / ``val_dataloader()`` when no datamodule is passed to ``fit``.

**Step outputs** (``training_step`` / ``validation_step`` return a mapping; ``MetricReduction`` reduces
it over micro-batches and ranks before anything is logged):

* a :class:`~verl_trainer.metrics.Metric` — reduced as it declares (SUM / MEAN / MIN / MAX);
* a plain number or 0-d tensor — a MEAN over ranks (use it for values equal on every rank: the
  engine's global ``loss``, ``grad_norm``, ``lr``);
* a list of per-micro-batch ``{name: Metric}`` dicts (``engine.train_batch(...)["metrics"]``) — merged
  in under their own names (the key is not used);
* anything else (tensors, batches) is passed to ``on_train_batch_end`` but not logged.

**Hooks a step may dispatch** (``self.trainer``): ``call_hook("on_rollout_end", batch)`` after rollout
and rewards; ``batch = call_before_update(batch)`` before the engine update (callbacks such as
``SequenceBalancing`` may return a re-partitioned batch); :meth:`TrainingModule.engine_step` dispatches
``on_micro_batches`` (the planned micro-batches), ``on_before_backward`` (per micro-batch),
``on_after_backward`` and ``on_before_optimizer_step``. The
Trainer steps every engine's LR scheduler once after each ``training_step``.

**Data parallelism**: ``self.trainer.dp_group`` / ``dp_rank`` / ``dp_size`` are those of the first
engine (the actor); the Trainer shards the data by them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from verl_trainer.engine.config import EngineConfig, OptimConfig

if TYPE_CHECKING:
    from verl_trainer.engine.base import BaseEngine
    from verl_trainer.trainer import Trainer

__all__ = ["EngineSpec", "StepOutput", "TrainingModule"]

StepOutput = Mapping[str, Any]
"""What ``training_step`` / ``validation_step`` return (see the module docstring)."""

MODEL_TYPES = ("language_model", "value_model")


@dataclass
class EngineSpec:
    """An engine the Trainer builds with its strategy (backend, precision, seed) and initialises.

    Attributes:
        model_type: ``"language_model"`` or ``"value_model"``.
        config: The engine config (model path, micro-batching, ...); dtypes come from the Trainer's
            precision.
        optim: Optimizer config; ``None`` builds an inference-only engine (e.g. a reference policy).
    """

    model_type: str
    config: EngineConfig
    optim: OptimConfig | None = None

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"EngineSpec.model_type={self.model_type!r}; choose one of {MODEL_TYPES}")
        if not isinstance(self.config, EngineConfig):
            raise TypeError(f"EngineSpec.config must be an EngineConfig, got {type(self.config).__name__}")


class TrainingModule:
    """Base class of what ``Trainer.fit`` trains (see the module docstring for the contract).

    Attributes:
        trainer: The Trainer running this module (set by ``fit`` / ``validate``).
        engines: The initialised engines, by the names :meth:`configure_engines` returned.
    """

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.engines: dict[str, BaseEngine] = {}

    @property
    def hparams(self) -> dict[str, Any]:
        """Hyperparameters logged once per run (plain data); override to report your config."""
        return {}

    def setup(self, stage: str) -> None:
        """Called on every rank at the start of ``fit`` / ``validate`` (``stage``), before the engines."""

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

    def state_dict(self) -> dict[str, Any]:
        """Non-engine state to checkpoint (plain data and tensors); engines are saved separately."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    # ------------------------------------------------------------------------------------ helpers
    def engine_step(
        self, engine: BaseEngine, batch: Any, loss_fn: Callable[..., Any], **kwargs: Any
    ) -> dict[str, Any]:
        """One optimizer step of ``engine`` on ``batch`` with the Trainer's backward/optimizer hooks.

        The same as ``engine.train_batch(batch, loss_fn)`` (zero grads, forward/backward of every
        micro-batch, clip and step), plus ``on_micro_batches``, ``on_before_backward`` per micro-batch,
        ``on_after_backward`` and ``on_before_optimizer_step``. Call it inside ``engine.train_mode()``.

        Args:
            engine: A trainable engine of this module.
            batch: This rank's ``[B, T]`` schema batch (a TensorDict).
            loss_fn: ``loss_fn(model_output, micro_batch, info) -> (loss, metrics)``.
            **kwargs: Passed to ``forward_backward_batch`` (e.g. ``calculate_entropy``).

        Returns:
            ``{"loss", "grad_norm", "lr", "step_skipped", "metrics", "num_micro_batches"}`` as
            ``train_batch`` returns them.
        """
        trainer = self.trainer
        if trainer is None:
            return engine.train_batch(batch, loss_fn, **kwargs)
        if engine.optimizer is None:
            raise RuntimeError("engine_step needs an engine built with an OptimConfig")
        engine.optimizer_zero_grad()
        loss_with_hooks = trainer.wrap_loss_fn(loss_fn)
        out = engine.forward_backward_batch(
            batch,
            loss_with_hooks,
            forward_only=False,
            micro_batch_hook=lambda micro_batches: trainer.call_hook("on_micro_batches", micro_batches),
            **kwargs,
        )
        trainer.call_hook("on_after_backward")
        trainer.call_hook("on_before_optimizer_step", engine.optimizer)
        lr = engine.get_lr()
        grad_norm = engine.optimizer_step()
        return {
            "loss": out["loss"],
            "grad_norm": grad_norm,
            "lr": lr,
            "step_skipped": not math.isfinite(grad_norm),
            "metrics": out["metrics"],
            "num_micro_batches": out["num_micro_batches"],
        }
