"""What one optimizer step tells its caller: :class:`StepHooks`.

:meth:`BaseEngine.train_batch <verl_trainer.engine.base.BaseEngine.train_batch>` is the one
implementation of an optimizer step (zero-grad → micro-batches → backward → clip → step → skipped-step).
A caller that wants to see inside it — the Trainer dispatching its callbacks — passes one
:class:`StepHooks`; the engine calls each hook that is set, at fixed points::

    on_before_zero_grad(optimizer)          first, before the gradients are cleared
    on_micro_batches(micro_batches)         the planned micro-batches, before the first forward
    on_before_backward(loss)                per micro-batch, before its backward
    on_after_backward()                     after the last backward
    on_before_optimizer_step(optimizer)     before clipping and the step

A hook left ``None`` is not called: a step nobody watches makes no call out of the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from tensordict import TensorDict

__all__ = ["NO_HOOKS", "STEP_HOOK_NAMES", "StepHooks"]


@dataclass(frozen=True)
class StepHooks:
    """Callbacks of one optimizer step (see the module docstring); ``None``: not called.

    Attributes:
        on_before_zero_grad: ``f(optimizer)``, before the gradients are cleared at the start of the step.
        on_micro_batches: ``f(micro_batches)``, the micro-batches the step will run (each ``[b, T]``),
            before the first forward.
        on_before_backward: ``f(loss)``, one micro-batch's loss (0-d), before its backward.
        on_after_backward: ``f()``, every micro-batch's backward is done; gradients are synchronised.
        on_before_optimizer_step: ``f(optimizer)``, before the gradients are clipped and the step.
    """

    on_before_zero_grad: Callable[[torch.optim.Optimizer], None] | None = None
    on_micro_batches: Callable[[list[TensorDict]], None] | None = None
    on_before_backward: Callable[[torch.Tensor], None] | None = None
    on_after_backward: Callable[[], None] | None = None
    on_before_optimizer_step: Callable[[torch.optim.Optimizer], None] | None = None


STEP_HOOK_NAMES: tuple[str, ...] = tuple(f.name for f in fields(StepHooks))
"""The hooks of one optimizer step, in the order the engine calls them."""

NO_HOOKS = StepHooks()
"""The hooks of a step nobody watches."""
