"""What the engine's compute methods return: :class:`BatchResult` and :class:`StepResult`.

Plain dicts at run time (``TypedDict``): the keys below are the contract of
``BaseEngine.forward_backward_batch`` / ``infer_batch`` and ``BaseEngine.train_batch``.
"""

from __future__ import annotations

from typing import Any, TypedDict

import torch

__all__ = ["BatchResult", "StepResult"]


class _BatchResultKeys(TypedDict):
    local_loss: float
    loss: float
    metrics: list[dict[str, Any]]
    num_micro_batches: int


class BatchResult(_BatchResultKeys, total=False):
    """``forward_backward_batch``'s result; ``infer_batch``'s always has ``model_output``.

    Keys:
        local_loss: This rank's sum of partial losses.
        loss: The mean over DP ranks of each rank's ``local_loss`` (the same on every rank).
        metrics: One dict per micro-batch, as the loss function returned it.
        num_micro_batches: Micro-batches run on this rank.
        model_output: Forward only: ``{key: [B, T]}`` in the original sample order.
    """

    model_output: dict[str, torch.Tensor]


class StepResult(TypedDict):
    """``train_batch``'s result: one optimizer step.

    Keys:
        loss: The global loss (as :class:`BatchResult`).
        grad_norm: The gradient norm before clipping (non-finite: the step was skipped).
        lr: The learning rate this step used.
        step_skipped: The gradient norm was not finite, so no update was applied.
        loss_scale_overflow: float16: the scaled gradients overflowed while the loss was finite.
        loss_scale: The float16 loss scale after the step; ``None`` without loss scaling.
        metrics: One dict per micro-batch, as the loss function returned it.
        num_micro_batches: Micro-batches run on this rank.
    """

    loss: float
    grad_norm: float
    lr: float
    step_skipped: bool
    loss_scale_overflow: bool
    loss_scale: float | None
    metrics: list[dict[str, Any]]
    num_micro_batches: int
