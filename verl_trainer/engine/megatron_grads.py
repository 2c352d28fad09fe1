"""Gradients of a Megatron engine: Megatron's DDP buffers in, the global norm and clipping out.

Megatron's ``DistributedDataParallel`` accumulates every micro-batch's gradient into its contiguous
``main_grad`` buffers and all-reduces them over the dp group (pre-scaled by ``1 / dp``: an average, as FSDP
does) in ``finish_grad_sync``. Megatron's own optimizer, which reads those buffers, allocates on CUDA; the
engine steps a torch optimizer (``engine/optimizers.py``) instead, its ``.grad`` pointed at ``main_grad``
(:func:`attach_main_grads`).

The total norm counts every gradient element once over the whole (dp, tp) layout: after the dp all-reduce
the dp ranks hold the same gradients (counted on one), a TP-split parameter's shards are summed over the TP
group, and a parameter replicated over TP (norms) is counted on TP rank 0 only, as Megatron's
``param_is_not_tensor_parallel_duplicate`` decides.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

__all__ = ["attach_main_grads", "global_grad_norm"]


def attach_main_grads(params: Iterable[torch.nn.Parameter]) -> None:
    """Point each parameter's ``.grad`` at its DDP ``main_grad`` (cast to the parameter's dtype if needed)."""
    for param in params:
        main = getattr(param, "main_grad", None)
        if main is not None and param.requires_grad:
            param.grad = main if main.dtype == param.dtype else main.to(param.dtype)


def _counted_once(param: torch.nn.Parameter, tp_rank: int) -> bool:
    """Megatron's rule: a TP-split parameter on every TP rank, a TP-replicated one on TP rank 0."""
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def global_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float | None,
                     tp_group: dist.ProcessGroup, tp_rank: int, tp_size: int,
                     ep_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """L2 norm of all gradients over the (dp, tp) layout; clips every gradient to ``max_norm`` when given.

    A TP collective (and an EP collective with ``ep_group``: the expert weights, Megatron's
    ``allreduce=False`` parameters, differ over it and their squares are summed there). Gradients must
    already be synchronised over dp.

    Returns:
        A float32 scalar, the same on every rank (``nan`` / ``inf`` when a gradient is not finite).
    """
    with_grad = [p for p in params if p.grad is not None]
    counted = [p.grad for p in with_grad if _counted_once(p, tp_rank)
               and (ep_group is None or getattr(p, "allreduce", True))]
    local = torch.nn.utils.get_total_norm(counted, 2.0, error_if_nonfinite=False, foreach=True) if counted \
        else torch.zeros(())
    squared = local.double().cpu() ** 2
    if ep_group is not None:  # the EP ranks hold different experts: their squares add up
        experts = [p.grad for p in with_grad if not getattr(p, "allreduce", True)]
        expert_sq = (torch.nn.utils.get_total_norm(experts, 2.0, error_if_nonfinite=False, foreach=True)
                     .double() ** 2) if experts else torch.zeros((), dtype=torch.float64)
        expert_sq = expert_sq.to(with_grad[0].grad.device) if with_grad else expert_sq
        dist.all_reduce(expert_sq, group=ep_group)
        squared = squared + expert_sq.cpu()
    if tp_size > 1:
        device_sq = squared.to(with_grad[0].grad.device) if with_grad else squared
        dist.all_reduce(device_sq, group=tp_group)
        squared = device_sq.cpu()
    norm = squared.sqrt().float()
    if max_norm is not None and with_grad:
        torch.nn.utils.clip_grads_with_norm_(with_grad, float(max_norm), norm, foreach=True)
    return norm
