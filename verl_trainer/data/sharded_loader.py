"""Deterministic, resumable data sharding over data-parallel ranks.

The Trainer takes a ``DataLoader`` (from a datamodule's ``train_dataloader()`` / ``val_dataloader()``,
the module's own, or passed directly) or a map-style ``Dataset`` (each item is one ready batch) and
re-creates it with a :class:`ResumableDistributedSampler`: every epoch is one seeded permutation of the
whole dataset (``seed + epoch``, like ``DistributedSampler``), padded to a multiple of the DP size, and
DP rank ``r`` reads positions ``r, r + dp, r + 2 dp, ...``. Ranks of one sequence-parallel group read
the same samples.

The position in the data is ``(epoch, batches consumed this epoch)`` (:class:`ShardedLoader`). It is
saved in every checkpoint; on resume the sampler skips the samples already consumed *globally*
(``batches * batch_size * dp``), so a resumed run reads exactly the batches the uninterrupted run would
have read, also when the DP size changed (as long as it divides the consumed sample count).

Validation (``tag_padding=True``): the positions the sampler repeats to fill the last round over the DP
ranks are duplicates; each batch's rows at those positions are turned into padding samples
(:func:`~verl_trainer.data.schema.mark_padding`: ``is_padding``, zero loss mask), so no validation
metric counts a sample twice and the values do not depend on the number of devices.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
from tensordict import TensorDict
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler, Sampler

from verl_trainer.data import schema
from verl_trainer.data.hf_batch import to_schema_batch
from verl_trainer.data.loader_position import LoaderPosition, limited_batches
from verl_trainer.data.schema import mark_padding
from verl_trainer.data.sharded_stream import IterableShardedLoader

__all__ = ["ResumableDistributedSampler", "ShardedLoader", "as_dataloader", "make_sharded_loader"]


class ResumableDistributedSampler(Sampler[int]):
    """Indices of one DP rank, per epoch, starting after ``start`` globally consumed samples.

    Args:
        num_samples: Dataset length.
        num_replicas: DP size.
        rank: DP rank.
        shuffle: Permute each epoch (``torch.randperm`` seeded with ``seed + epoch``).
        seed: Base seed, the same on every rank.
    """

    def __init__(self, num_samples: int, num_replicas: int, rank: int, shuffle: bool, seed: int) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} must be in [0, num_replicas={num_replicas})")
        self.num_samples = num_samples
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.start = 0
        self.total = -(-num_samples // num_replicas) * num_replicas  # padded to a multiple of dp

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of ``epoch``."""
        self.epoch = epoch

    def set_start(self, consumed: int) -> None:
        """Skip the first ``consumed`` samples of the epoch's global order (a multiple of the DP size)."""
        if consumed % self.num_replicas:
            raise ValueError(
                f"cannot resume: {consumed} samples were consumed this epoch, which is not a multiple of "
                f"the data-parallel size {self.num_replicas}; resume with the DP size of the checkpoint"
            )
        self.start = consumed

    def global_order(self) -> torch.Tensor:
        """``[total]`` dataset indices of this epoch, padded by repeating from the start."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples, generator=g)
        else:
            order = torch.arange(self.num_samples)
        if self.total > self.num_samples and self.num_samples > 0:
            reps = -(-self.total // self.num_samples)
            order = order.repeat(reps)[: self.total]
        return order

    def __iter__(self) -> Iterator[int]:
        rest = self.global_order()[self.start:]
        return iter(rest[self.rank::self.num_replicas].tolist())

    def repeated(self) -> torch.Tensor:
        """``[len(self)]`` bool, in this rank's order: True where the index repeats one to pad the epoch."""
        positions = torch.arange(self.total)[self.start:][self.rank::self.num_replicas]
        return positions >= self.num_samples

    def __len__(self) -> int:
        return max(0, self.total - self.start) // self.num_replicas


def refuse_raw_rows(source: Any, what: str) -> None:
    """An HF ``datasets`` object of rows is refused naming the datamodule that takes it (no-op otherwise).

    Raises:
        TypeError: ``source`` is a ``datasets.Dataset`` / ``DatasetDict`` / ``IterableDataset``.
    """
    if type(source).__module__.split(".")[0] == "datasets":
        raise TypeError(
            f"the {what} is a {type(source).__name__} of rows, which needs tokenising and batching: pass "
            "datamodule=PromptDataModule(DataConfig(train_batch_size=...), tokenizer, train_dataset=ds) (RL) "
            "or SFTDataModule(...) (SFT) from verl_trainer.algorithms"
        )


def as_dataloader(source: Any, what: str) -> DataLoader:
    """``source`` as a DataLoader: a DataLoader as is, a Dataset of ready batches unbatched.

    Raises:
        TypeError: For anything else.
    """
    if isinstance(source, DataLoader):
        return source
    if isinstance(source, IterableDataset):
        return DataLoader(source, batch_size=None)
    if isinstance(source, Dataset) and not isinstance(source, IterableDataset) and hasattr(source, "__len__"):
        return DataLoader(source, batch_size=None, shuffle=False)
    refuse_raw_rows(source, what)
    raise TypeError(
        f"the {what} must be a torch DataLoader (over a map-style or iterable dataset) or a Dataset whose "
        f"items are batches, got {type(source).__name__}"
    )


def _tagged(batch: Any, rows: torch.Tensor) -> Any:
    """``batch`` with ``rows`` turned into padding samples (unchanged when none is).

    ``rows`` has one entry per dataset item; a batch of several samples per item (preference pairs) carries
    ``group_id`` = the item's index in the batch (``verl_trainer.data.preference``), which maps them.
    """
    if not isinstance(batch, TensorDict):
        if rows.any():
            raise TypeError(
                f"validation batches must be TensorDicts to exclude the repeated samples that pad the data "
                f"over the DP ranks from the metrics, got {type(batch).__name__}"
            )
        return batch
    if rows.numel() != batch.batch_size[0] and schema.GROUP_ID in batch.keys():
        item = batch[schema.GROUP_ID].long()
        if item.numel() and 0 <= int(item.min()) and int(item.max()) < rows.numel():
            rows = rows[item]
    if rows.numel() != batch.batch_size[0]:
        raise ValueError(f"batch of {batch.batch_size[0]} samples for {rows.numel()} sampled indices")
    return mark_padding(batch, rows)


class ShardedLoader(LoaderPosition):
    """A DataLoader re-created with a :class:`ResumableDistributedSampler`, plus its position.

    Args:
        loader: The user's DataLoader; its dataset, batch size, collate function, ``drop_last`` and worker
            settings are kept; ``shuffle`` is read from its sampler (a ``RandomSampler`` shuffles).
        dp_rank: This rank's DP rank.
        dp_size: DP size.
        seed: Shuffle seed.
        tag_padding: Turn the rows that repeat a sample to fill the last round into padding samples
            (validation; batches must be ``TensorDict``s).
        limit: ``limit_*_batches``: batches per epoch (an int, or a fraction of the epoch's batches).

    Raises:
        TypeError: For an iterable dataset or a custom batch sampler.
    """

    def __init__(self, loader: DataLoader, dp_rank: int, dp_size: int, seed: int,
                 tag_padding: bool = False, limit: int | float | None = None) -> None:
        dataset = loader.dataset
        if isinstance(dataset, IterableDataset):
            raise TypeError(
                "an IterableDataset cannot be sharded and resumed exactly; use a map-style dataset"
            )
        if loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler:
            raise TypeError(
                f"a DataLoader with a custom batch_sampler ({type(loader.batch_sampler).__name__}) cannot be "
                f"re-sharded; give a batch_size (and collate_fn) instead"
            )
        self.batch_size = loader.batch_size
        self.dp_size = dp_size
        self.sampler = ResumableDistributedSampler(
            len(dataset), dp_size, dp_rank, shuffle=isinstance(loader.sampler, RandomSampler), seed=seed
        )
        self.loader = DataLoader(
            dataset,
            batch_size=loader.batch_size,
            sampler=self.sampler,
            collate_fn=loader.collate_fn if loader.batch_size is not None else None,
            drop_last=loader.drop_last,
            num_workers=loader.num_workers,
            pin_memory=loader.pin_memory,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            persistent_workers=loader.persistent_workers if loader.num_workers > 0 else False,
        )
        self.tag_padding = tag_padding
        self.limit = limit
        self.epoch = 0
        self.batches = 0  # consumed this epoch, on this rank

    def __len__(self) -> int:
        return len(self.loader)

    def limited_len(self) -> int:
        """Batches of one whole epoch under ``limit`` (the same on every DP rank)."""
        total = -(-self.sampler.total // self.dp_size)
        total = total // self.batch_size if self.loader.drop_last and self.batch_size else (
            -(-total // self.batch_size) if self.batch_size else total)
        return int(limited_batches(total, self.limit))

    def exhausted(self) -> bool:
        """Whether the current epoch's (limited) batches are all consumed."""
        return self.batches >= self.limited_len()

    def epoch_batches(self) -> Iterator[Any]:
        """The batches left in the current epoch (under ``limit``), from the current position.

        HF-style dict batches become schema batches (``data/hf_batch.py: to_schema_batch``).
        """
        self.sampler.set_epoch(self.epoch)
        self.sampler.set_start(self.batches * self.samples_per_batch * self.dp_size)
        left = self.limited_len() - self.batches
        repeated, per = self.sampler.repeated(), self.batch_size
        for i, batch in enumerate(self.loader):
            if i >= left:
                return
            batch = to_schema_batch(batch)
            if self.tag_padding:
                rows = repeated[i * per:(i + 1) * per] if per is not None else repeated[i].expand(len(batch))
                batch = _tagged(batch, rows)
            yield batch


    def peek(self, count: int) -> list[Any]:
        """Up to ``count`` batches that follow the current position, without consuming them.

        When the current epoch's batches are all consumed, the first batches of the next epoch (its own
        permutation). The batches are read from a fresh single-process loader over the same dataset and
        sampler settings, so they are the ones :meth:`epoch_batches` yields next.

        Args:
            count: Batches wanted (one optimizer step's ``accumulate_grad_batches``).
        """
        epoch, batches = (self.epoch + 1, 0) if self.exhausted() else (self.epoch, self.batches)
        sampler = copy.copy(self.sampler)
        sampler.set_epoch(epoch)
        sampler.set_start(batches * self.samples_per_batch * self.dp_size)
        loader = DataLoader(self.loader.dataset, batch_size=self.batch_size, sampler=sampler,
                            collate_fn=self.loader.collate_fn if self.batch_size is not None else None,
                            drop_last=self.loader.drop_last)
        left = min(count, self.limited_len() - batches)
        return [to_schema_batch(batch) for _, batch in zip(range(left), loader)]


def make_sharded_loader(loader: DataLoader, dp_rank: int, dp_size: int, seed: int, tag_padding: bool = False,
                        limit: int | float | None = None) -> ShardedLoader | IterableShardedLoader:
    """The loader of a stage, sharded over the DP ranks.

    :class:`ShardedLoader` for a map-style dataset, ``IterableShardedLoader`` for an iterable one
    (``data/sharded_stream.py``).
    """
    if isinstance(loader.dataset, IterableDataset):
        return IterableShardedLoader(loader, dp_rank, dp_size, limit=limit)
    return ShardedLoader(loader, dp_rank, dp_size, seed, tag_padding=tag_padding, limit=limit)
