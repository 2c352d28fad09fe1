"""The bucketed weight broadcast: trainer rank 0 streams full tensors to every rollout rank.

Wire format, per bucket (three broadcasts from group rank 0 on the pool's weight group)::

    header  int64 [3]          (meta bytes, data bytes, 1 on the last bucket else 0)
    meta    uint8 [meta bytes] JSON list of [name, dtype, shape, total bytes, offset]
    data    uint8 [data bytes] the entries' bytes, in order

A tensor larger than a bucket is sent in bucket-size slices (``offset`` says where a slice goes); the
receiver yields a tensor once its last slice arrived. The sender holds one bucket and the tensor the
iterator gave it (for an FSDP / FSDP2 engine, ``get_per_tensor_param`` gathers one parameter at a time),
never a second copy of all tensors. The receiver's tensors are new CPU (or ``device``) tensors, bit-equal
to the sender's (bytes are copied, no cast).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["receive_weights", "send_weights"]

_Entry = tuple[str, str, tuple[int, ...], int, int]


def _broadcast(group: Any, tensor: torch.Tensor, timeout: timedelta | None) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    if timeout is not None:
        opts.timeout = timeout
    group.broadcast([tensor], opts).wait()


def _flush(group: Any, meta: list[_Entry], data: torch.Tensor, used: int, last: bool,
           timeout: timedelta | None) -> None:
    blob = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8).to(data.device)
    header = torch.tensor([blob.numel(), used, int(last)], dtype=torch.int64, device=data.device)
    _broadcast(group, header, timeout)
    _broadcast(group, blob, timeout)
    if used:
        _broadcast(group, data[:used], timeout)


def send_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], group: Any, bucket_bytes: int,
                 device: torch.device | str = "cpu", timeout: timedelta | None = None) -> int:
    """Broadcast ``named_tensors`` (full tensors, any dtype) from group rank 0, in buckets.

    Args:
        named_tensors: Consumed lazily, one tensor at a time.
        group: The pool's weight group (this process is its rank 0).
        bucket_bytes: Bytes per bucket (``>= 1``); a larger tensor is split over several buckets.
        device: Where the bucket lives (``cuda`` for NCCL).
        timeout: Per broadcast; ``None``: the group's.

    Returns:
        Bytes sent (tensor data only).
    """
    bucket = torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
    meta: list[_Entry] = []
    used = sent = 0
    for name, tensor in named_tensors:
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        total, offset = raw.numel(), 0
        dtype, shape = str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)
        if total == 0:
            meta.append((name, dtype, shape, 0, 0))
        while offset < total:
            take = min(total - offset, bucket_bytes - used)
            bucket[used:used + take].copy_(raw[offset:offset + take])
            meta.append((name, dtype, shape, total, offset))
            used, offset, sent = used + take, offset + take, sent + take
            if used == bucket_bytes:
                _flush(group, meta, bucket, used, False, timeout)
                meta, used = [], 0
        del raw, tensor
    _flush(group, meta, bucket, used, True, timeout)
    return sent


def receive_weights(group: Any, device: torch.device | str = "cpu",
                    timeout: timedelta | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Receive what :func:`send_weights` broadcasts; yield each tensor once complete (in sent order).

    Args:
        group: The pool's weight group (this process is a rank other than 0).
        device: Where the received tensors are made.
        timeout: Per broadcast; ``None``: the group's.
    """
    partial: dict[str, tuple[torch.Tensor, int]] = {}
    while True:
        header = torch.empty(3, dtype=torch.int64, device=device)
        _broadcast(group, header, timeout)
        meta_bytes, used, last = (int(x) for x in header.tolist())
        blob = torch.empty(meta_bytes, dtype=torch.uint8, device=device)
        _broadcast(group, blob, timeout)
        data = torch.empty(used, dtype=torch.uint8, device=device)
        if used:
            _broadcast(group, data, timeout)
        cursor = 0
        for name, dtype, shape, total, offset in json.loads(blob.cpu().numpy().tobytes()):
            buffer, filled = partial.get(name) or (torch.empty(total, dtype=torch.uint8, device=device), 0)
            take = min(total - offset, used - cursor)
            buffer[offset:offset + take].copy_(data[cursor:cursor + take])
            cursor, filled = cursor + take, filled + take
            if filled == total:
                partial.pop(name, None)
                yield name, buffer.view(getattr(torch, dtype)).reshape(shape)
            else:
                partial[name] = (buffer, filled)
        if last:
            if partial:
                raise RuntimeError(f"weight broadcast ended with incomplete tensors {sorted(partial)}")
            return
