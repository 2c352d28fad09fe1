"""What one optimizer step tells its caller: :class:`StepHooks`.

:meth:`BaseEngine.train_batch <verl_trainer.engine.base.BaseEngine.train_batch>` is the one
implementation of an optimizer step (zero-grad → micro-batches → backward → clip → step → skipped-step).
A caller that wants to see inside it — the Trainer dispatching its callbacks — passes one
:class:`StepHooks`; the engine calls it at fixed points::

    on_before_zero_grad(optimizer)          first, before the gradients are cleared
    on_micro_batches(micro_batches)         the planned micro-batches, before the first forward
    on_before_backward(loss)                per micro-batch, before its backward
    on_after_backward()                     after the last backward
    on_before_optimizer_step(optimizer)     before clipping and the step

Every method is a no-op here; override the ones you need.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

__all__ = ["StepHooks"]


class StepHooks:
    """Callbacks of one optimizer step (see the module docstring); the base class does nothing."""

    def on_before_zero_grad(self, optimizer: Any) -> None:
        """Before ``optimizer``'s gradients are cleared at the start of the step."""

    def on_micro_batches(self, micro_batches: list[TensorDict]) -> None:
        """The micro-batches the step will run (each ``[b, T]``), before the first forward."""

    def on_before_backward(self, loss: torch.Tensor) -> None:
        """One micro-batch's loss (0-d), before its backward."""

    def on_after_backward(self) -> None:
        """Every micro-batch's backward is done; gradients are synchronised."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """Before the gradients are clipped and ``optimizer`` steps."""


NO_HOOKS = StepHooks()
"""The hooks of a step nobody watches."""
