"""The one home of the process-group helpers every layer uses (rank, world, barrier, small all-reduces).

Every function works without an initialised process group (a single process): ranks are 0, sizes 1,
barriers and reductions are no-ops. Small tensors travel through the group's device when the backend
needs one (nccl/hccl: the current accelerator; gloo: the CPU) and come back on their own device.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from verl_trainer.utils.device import get_torch_device

__all__ = [
    "all_gather_object",
    "all_reduce",
    "barrier",
    "broadcast_object",
    "get_rank",
    "get_world_size",
    "is_distributed",
    "is_initialized",
    "set_collective_timeout",
]


def is_initialized() -> bool:
    """True when a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def is_distributed(group: dist.ProcessGroup | None = None) -> bool:
    """True when ``group`` (``None``: the default group) exists and has more than one rank."""
    return is_initialized() and dist.get_world_size(group) > 1


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    """The size of ``group`` (1 without a process group)."""
    return dist.get_world_size(group) if is_initialized() else 1


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait for every rank of ``group`` (a no-op without a process group)."""
    if is_initialized():
        dist.barrier(group=group)


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    backend = str(dist.get_backend(group))
    if "gloo" in backend:
        return torch.device("cpu")
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return get_torch_device()


def all_reduce(values: torch.Tensor, group: dist.ProcessGroup | None = None,
               op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce a small tensor over ``group``; returns a new tensor on ``values``' device.

    Args:
        values: Any small tensor (counts, a loss sum, ``[k]`` lengths).
        group: The process group (``None``: the default group).
        op: The reduction.

    Returns:
        The reduced values (``values`` itself is unchanged); a copy of ``values`` when not distributed.
    """
    out = values.detach().clone()
    if not is_distributed(group):
        return out
    work = out.to(_collective_device(group))
    dist.all_reduce(work, op=op, group=group)
    return work.to(values.device)


def all_gather_object(obj: object, group: dist.ProcessGroup | None = None) -> list[object]:
    """``obj`` of every rank of ``group``, in rank order (plain data only; ``[obj]`` without a group)."""
    if not is_distributed(group):
        return [obj]
    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: object, src: int = 0, group: dist.ProcessGroup | None = None) -> object:
    """``obj`` of global rank ``src`` on every rank of ``group`` (plain data only; identity without one)."""
    if not is_distributed(group):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def set_collective_timeout(timeout: timedelta, groups: Sequence[dist.ProcessGroup | None] = (None,)) -> None:
    """Make collectives on ``groups`` (``None``: the default group) fail after ``timeout``.

    Groups created later (device meshes) get torch's backend default (30 min for gloo) unless they are
    passed here too; the strategy does that for the meshes it builds.
    """
    from torch.distributed.distributed_c10d import _set_pg_timeout

    for group in groups:
        _set_pg_timeout(timeout, group)
