"""Offload part: move parameters, gradients and optimizer state between the device and CPU.

Used by ``BaseEngine.to`` implementations and therefore by the mode contexts (``BaseEngine.train_mode``
/ ``eval_mode``) when ``param_offload`` / ``optimizer_offload`` is on.
"""

from __future__ import annotations

import torch


def move_optimizer_state(optimizer: torch.optim.Optimizer | None, device: torch.device | str) -> None:
    """Move every tensor of the optimizer state (exp_avg, exp_avg_sq, step, ...) to ``device``."""
    if optimizer is None:
        return
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != torch.device(device):
                state[key] = value.to(device, non_blocking=True)


def move_grads(module: torch.nn.Module | None, device: torch.device | str) -> None:
    """Move every existing ``.grad`` of ``module``'s parameters to ``device``."""
    if module is None:
        return
    for param in module.parameters():
        if param.grad is not None and param.grad.device != torch.device(device):
            param.grad = param.grad.to(device, non_blocking=True)


def move_fsdp1_params(module: torch.nn.Module, device: torch.device | str) -> None:
    """Move the local shards of an FSDP1 module's flat parameters to ``device``.

    FSDP1 keeps each unit's sharded flat parameter in ``flat_param._local_shard``; moving ``.data`` and
    re-pointing ``_local_shard`` keeps the two in sync (units with FSDP's own CPU offload are skipped).
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    for unit in FullyShardedDataParallel.fsdp_modules(module):
        handle = getattr(unit, "_handle", None)
        if handle is None or getattr(handle, "_offload_params", False):
            continue
        flat = handle.flat_param
        if flat.data.device == torch.device(device):
            continue
        flat.data = flat.data.to(device, non_blocking=True)
        flat._local_shard = flat.data


def move_module(module: torch.nn.Module | None, device: torch.device | str, fsdp1: bool = False) -> None:
    """Move a (possibly FSDP-sharded) module's parameters to ``device``.

    Args:
        module: The module (FSDP2 modules move with ``Module.to``; FSDP1 units need
            :func:`move_fsdp1_params`).
        device: Target device.
        fsdp1: ``module`` is wrapped with FSDP1.

    """
    if module is None:
        return
    if fsdp1:
        move_fsdp1_params(module, device)
    else:
        module.to(device)
    if torch.device(device).type == "cpu" and torch.cuda.is_available():
        torch.cuda.empty_cache()
