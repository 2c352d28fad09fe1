"""Dynamic loss scaling for float16 compute (``precision="16-mixed"``): which gradient scaler an engine uses.

The engine multiplies each micro-batch's loss by the scale before its backward, unscales the gradients
before the grad norm and clipping, and skips the optimizer step when a gradient is inf/NaN; the scale is
halved after such a step and doubled after ``growth_interval`` clean ones (torch's defaults). The step
logic is :meth:`verl_trainer.engine.optim.OptimizerMixin.optimizer_step`.

* fsdp2 (and one process): ``torch.amp.GradScaler``; its inf check on DTensor gradients max-reduces the
  flag over the gradients' mesh, so every rank agrees.
* fsdp (FSDP1): ``ShardedGradScaler`` (it all-reduces the flag itself).
* deepspeed: DeepSpeed's own ``fp16`` section with ``loss_scale: 0`` (dynamic), see ``deepspeed_config.py``.

The scaler's state (scale, growth tracker) is plain data, saved in the engine checkpoint's extra state.
"""

from __future__ import annotations

import torch

from verl_trainer.engine.config import EngineConfig, to_dtype

__all__ = ["build_grad_scaler", "uses_loss_scaling"]


def uses_loss_scaling(config: EngineConfig) -> bool:
    """Whether the engine computes in float16 (``param_dtype``) and so needs a loss scaler."""
    return to_dtype(config.param_dtype) == torch.float16


def build_grad_scaler(device_type: str, fsdp1: bool) -> torch.amp.GradScaler:
    """The gradient scaler of a float16 FSDP engine (see the module docstring)."""
    if fsdp1:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device_type)
    return torch.amp.GradScaler(device_type)
