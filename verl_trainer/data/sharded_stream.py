"""Iterable (streaming) datasets, sharded over data-parallel ranks and resumable by position.

A DataLoader over an ``IterableDataset`` has no length and no sampler, so :class:`IterableShardedLoader`
shards it by position: DP rank ``r`` of ``dp`` reads items ``r, r + dp, ...`` of the stream (a dataset with
a ``shard`` attribute, such as :class:`~verl_trainer.data.sft.IterableSFTDataset`, is told ``(r, dp)`` and
skips the others before tokenising them; any other one is wrapped). Ranks of one SP group share a DP rank,
so they read the same items. Before every batch the ranks agree that each of them has one (a one-element
all-reduce), so an uneven end of the stream ends the epoch on every rank together (the uneven tail is
dropped, as ``drop_last`` would) instead of leaving a rank waiting in a collective. The position is the
batches consumed this epoch; a resumed run skips that many batches. ``limit_*_batches`` must be an int
(a fraction of an unknown length has no meaning).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from verl_trainer.data.hf_batch import to_schema_batch
from verl_trainer.data.loader_position import LoaderPosition, limited_batches
from verl_trainer.utils.distributed import all_reduce

__all__ = ["IterableShardedLoader"]


class _Strided(IterableDataset):
    """Items ``rank, rank + shards, ...`` of ``dataset``."""

    def __init__(self, dataset: IterableDataset, rank: int, shards: int) -> None:
        self.dataset, self.rank, self.shards = dataset, rank, shards

    def __iter__(self) -> Iterator[Any]:
        for i, item in enumerate(self.dataset):
            if i % self.shards == self.rank:
                yield item


class IterableShardedLoader(LoaderPosition):
    """A DataLoader over an iterable dataset, re-created for one DP rank (see the module docstring).

    Args:
        loader: The user's DataLoader (batch size, collate function, ``drop_last`` kept; ``num_workers``
            must be 0: each worker would read the whole stream).
        dp_rank: This rank's DP rank.
        dp_size: DP size.
        limit: ``limit_*_batches`` (an int or ``None``).

    Raises:
        ValueError: Workers, or a fractional limit.
    """

    def __init__(self, loader: DataLoader, dp_rank: int, dp_size: int,
                 limit: int | float | None = None) -> None:
        dataset = loader.dataset
        if loader.num_workers:
            raise ValueError(
                f"an iterable dataset with num_workers={loader.num_workers}: every worker would read the "
                "whole stream; use num_workers=0 (or a map-style dataset)"
            )
        limited_batches(None, limit)  # a fraction of an unknown length is an error, here, before any step
        if hasattr(dataset, "shard"):
            dataset.shard = (dp_rank, dp_size)
        else:
            dataset = _Strided(dataset, dp_rank, dp_size)
        self.loader = DataLoader(dataset, batch_size=loader.batch_size, collate_fn=loader.collate_fn,
                                 drop_last=loader.drop_last)
        self.batch_size, self.dp_size, self.limit = loader.batch_size, dp_size, limit
        self.epoch, self.batches = 0, 0
        self._ended = False

    def limited_len(self) -> int | None:
        """Batches of one epoch: the int limit, or ``None`` (unknown until the stream ends)."""
        return self.limit

    def exhausted(self) -> bool:
        """Whether the current epoch ended (the stream ran out on some rank, or the limit was reached)."""
        return self._ended or (self.limit is not None and self.batches >= self.limit)

    def epoch_batches(self) -> Iterator[Any]:
        """This rank's batches of the current epoch from the current position, while every rank has one."""
        self._ended = False
        stream = iter(self.loader)
        for _ in range(self.batches):  # resume: skip what was consumed
            next(stream, None)
        while self.limit is None or self.batches < self.limit:
            batch = next(stream, None)
            if not _all_have(batch is not None):
                self._ended = True
                return
            yield to_schema_batch(batch)

    def next_epoch(self) -> None:
        """Move to the start of the next epoch (the stream is read again)."""
        super().next_epoch()
        self._ended = False


def _all_have(has: bool) -> bool:
    """Whether every rank has a batch (MIN over the world; the value itself without a process group)."""
    flag = torch.tensor([1.0 if has else 0.0])
    return bool(all_reduce(flag, op=dist.ReduceOp.MIN)[0] > 0)
