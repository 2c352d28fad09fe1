"""What one ``forward_backward_batch`` carries, and its default schedule.

``BaseEngine.forward_backward_batch`` is the one micro-batch loop of every engine, in the order
docs/design.md §4 fixes (global denominators before the split, the same micro-batch count on every DP rank,
outputs back in the original order). Every schedule calls :meth:`MicroBatchStep.loss` for
``loss_fn(model_output, micro_batch, info)`` (never divided by the number of micro-batches) and
:meth:`MicroBatchStep.keep` for forward-only outputs.

A schedule is an object whose ``run(engine, step)`` runs the micro-batches and returns
``(local loss sum, per-micro-batch metrics, forward-only outputs or None)`` (:data:`ScheduleResult`):
:data:`SEQUENTIAL` (:class:`SequentialSchedule`: each micro-batch forward then backward, gradients synced on
the last) for every engine without pipeline stages; ``engine/pipeline.py: PipelineParallel`` with
``pipeline_model_parallel_size > 1``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from tensordict import TensorDict

from verl_trainer.core_algos.aggregation import GlobalBatchInfo
from verl_trainer.data import schema
from verl_trainer.engine.config import EngineConfig
from verl_trainer.engine.heads import ModelType
from verl_trainer.engine.hooks import StepHooks
from verl_trainer.engine.micro_batch import restore_dynamic_batch

if TYPE_CHECKING:
    from transformers import PretrainedConfig


LossFunction = Callable[..., "tuple[torch.Tensor, dict[str, Any]]"]
"""``loss_fn(model_output, micro_batch, info) -> (loss, metrics)`` (see ``core_algos/aggregation.py``)."""

__all__ = [
    "SEQUENTIAL", "LossFunction", "MicroBatchStep", "Schedule", "ScheduleResult", "ScheduledEngine",
    "SequentialSchedule",
]


def _pad_width(t: torch.Tensor, width: int) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    pad = t.new_zeros((t.shape[0], width - t.shape[1], *t.shape[2:]))
    return torch.cat([t, pad], 1)


@dataclass
class MicroBatchStep:
    """One ``forward_backward_batch``: its micro-batches and what every schedule records of them.

    Attributes:
        data: This DP rank's whole batch ``[B, T]`` (its width and device shape the forward-only outputs).
        micro_batches: The planned micro-batches ``[b, T]``, in run order.
        batch_idx: Original index of each sample in micro-batch order (``-1``: padding sample), or ``None``.
        info: The step's global denominators.
        loss_function: ``loss_fn(model_output, micro_batch, info) -> (loss, metrics)`` or ``None``.
        forward_only: No backward.
        calculate_entropy: Language model: also compute ``entropy``.
        temperature: The logits' temperature.
        hooks: ``on_before_backward`` sees each micro-batch's loss before its backward.
        losses: Each micro-batch's loss ``[]`` (float64, detached), in run order.
        metrics: Each micro-batch's metrics, in run order.
        kept: Forward only: the outputs ``{key: [b, t]}`` of each micro-batch, by index.
    """

    data: TensorDict
    micro_batches: list[TensorDict]
    batch_idx: list[int] | None
    info: GlobalBatchInfo
    loss_function: LossFunction | None
    forward_only: bool
    calculate_entropy: bool
    temperature: float
    hooks: StepHooks
    losses: list[torch.Tensor] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    kept: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def loss(self, outputs: dict[str, torch.Tensor], micro_batch: TensorDict) -> torch.Tensor:
        """The micro-batch's loss from its outputs ``{key: [b, t]}``; recorded, and shown to the hooks."""
        loss, metrics = self.loss_function(outputs, micro_batch, self.info)
        if not self.forward_only and self.hooks.on_before_backward is not None:
            self.hooks.on_before_backward(loss)
        self.losses.append(loss.detach().to(torch.float64))
        self.metrics.append(dict(metrics or {}))
        return loss

    def keep(self, index: int, outputs: dict[str, torch.Tensor]) -> None:
        """Keep micro-batch ``index``'s forward-only outputs ``{key: [b, t]}``."""
        self.kept[index] = {key: value.detach() for key, value in outputs.items()}

    def local_loss(self) -> torch.Tensor:
        """The sum of this rank's micro-batch losses (float64 on the CPU; one device sync)."""
        if not self.losses:
            return torch.zeros((), dtype=torch.float64)
        return torch.stack(self.losses).sum().cpu()

    @property
    def out_device(self) -> torch.device:
        """Where forward-only outputs are returned: the input batch's device (CPU when it has none)."""
        return self.data.device if self.data.device is not None else torch.device("cpu")

    def model_output(self) -> dict[str, torch.Tensor]:
        """The kept outputs as ``{key: [B, T]}`` in the original sample order (padding samples dropped)."""
        width = self.data[schema.INPUT_IDS].shape[1]
        keys = self.kept[0].keys() if self.kept else ()
        out = {}
        for key in keys:
            values = torch.cat([_pad_width(self.kept[i][key], width) for i in range(len(self.kept))])
            out[key] = values if self.batch_idx is None else restore_dynamic_batch(values, self.batch_idx)
        return out


ScheduleResult = tuple[torch.Tensor, list[dict[str, Any]], dict[str, torch.Tensor] | None]
"""``(local loss sum [] float64, per-micro-batch metrics, forward only: the outputs {key: [B, T]} in the
original order on ``step.out_device``, else None)``, on this rank."""


class ScheduledEngine(Protocol):
    """What a schedule uses of the engine whose micro-batches it runs (``BaseEngine`` has all of it).

    The sequential schedule calls the three methods; the pipeline schedule reads the attributes (the
    stage module, its device and dtypes, the model type's outputs).
    """

    device: torch.device
    module: torch.nn.Module | None
    config: EngineConfig
    model_config: PretrainedConfig
    model_type: ModelType

    def forward_micro_batch(self, micro_batch: TensorDict, calculate_entropy: bool = False,
                            temperature: float | None = None) -> dict[str, torch.Tensor]:
        """The micro-batch's outputs ``{key: [b, t]}``."""

    def _backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss."""

    def _grad_sync_context(self, is_last: bool) -> contextlib.AbstractContextManager:
        """Context around a micro-batch's forward and backward; gradients synced when ``is_last``."""


class Schedule(Protocol):
    """How the micro-batches of one step run (see the module docstring)."""

    def run(self, engine: ScheduledEngine, step: MicroBatchStep) -> ScheduleResult:
        """Run every micro-batch of ``step`` forward (and backward unless forward only); their results."""


class SequentialSchedule:
    """Each micro-batch forward then backward, in order; gradients synced on the last one only."""

    def run(self, engine: ScheduledEngine, step: MicroBatchStep) -> ScheduleResult:
        """Forward, loss and backward of each micro-batch (``engine._grad_sync_context`` around each).

        Returns:
            This rank's own losses and metrics, and (forward only) its outputs restored to the original
            order.
        """
        last = len(step.micro_batches) - 1
        with torch.no_grad() if step.forward_only else contextlib.nullcontext():
            for i, micro_batch in enumerate(step.micro_batches):
                micro_batch = micro_batch.to(engine.device)
                sync = engine._grad_sync_context(i == last) if not step.forward_only else None
                with sync or contextlib.nullcontext():
                    outputs = engine.forward_micro_batch(micro_batch, step.calculate_entropy,
                                                         step.temperature)
                    if step.loss_function is not None:
                        loss = step.loss(outputs, micro_batch)
                        if not step.forward_only:
                            engine._backward(loss)
                if step.forward_only:
                    step.keep(i, outputs)
        outputs = None
        if step.forward_only:
            outputs = {key: value.to(step.out_device) for key, value in step.model_output().items()}
        return step.local_loss(), step.metrics, outputs


SEQUENTIAL = SequentialSchedule()
"""The schedule of every engine without pipeline stages."""
