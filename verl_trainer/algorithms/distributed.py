"""Batch operations of an RL step that must agree over the data-parallel ranks (SPMD).

Every function here is collective over the DP group when one is given (call it on every rank, in the
same order) and reduces only a few numbers; no samples move.

* :func:`global_masked_whiten`: whitening with the mean and variance of the **whole** step batch (all
  DP ranks), so PPO's GAE advantages do not depend on the dp size. verl whitens on its driver, which
  holds the whole batch; here each rank contributes masked sums.
* :func:`split_mini_batches`: the PPO mini-batches of one step; every rank gets the same number of
  non-empty mini-batches (a rank short of samples gets ``is_padding`` samples that train nothing), so no
  rank runs an engine step the others do not.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_trainer.data import schema
from verl_trainer.utils.distributed import all_reduce

__all__ = [
    "count_mini_batches",
    "global_masked_whiten",
    "split_mini_batches",
]


def global_masked_whiten(values: torch.Tensor, mask: torch.Tensor,
                         group: dist.ProcessGroup | None = None, shift_mean: bool = True) -> torch.Tensor:
    """Whiten ``values`` with the masked mean and unbiased variance of the whole DP batch.

    Equals :func:`verl_trainer.core_algos.masked_whiten` of the concatenation of every rank's batch
    (to float round-off: the statistics are accumulated in float64): ``(x - mean) / sqrt(var + 1e-8)``.
    Two all-reduces of two numbers each.

    Args:
        values: ``[B, T]`` on this rank.
        mask: ``[B, T]`` bool or 0/1.
        group: The DP group (``None``: the default group, if any).
        shift_mean: If False, the mean is added back (only the scale is normalised).

    Returns:
        ``[B, T]`` in the dtype of ``values`` (every position, as ``masked_whiten``; multiply by the mask
        to zero the rest).

    Raises:
        ValueError: Fewer than two masked positions over all ranks.
    """
    m = mask.bool()
    x = values.detach().to(torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    local = torch.stack([torch.where(m, x, zero).sum(), m.sum().to(torch.float64)]).cpu()
    total, count = all_reduce(local, group).tolist()
    if count < 2:
        raise ValueError(
            f"whitening needs at least 2 masked-in positions over all DP ranks, got {int(count)}; use a "
            "larger batch"
        )
    mean = total / count
    sq_dev = torch.where(m, (x - mean) ** 2, zero).sum().reshape(1).cpu()
    var = float(all_reduce(sq_dev, group)[0]) / (count - 1)
    whitened = (x - mean) / math.sqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened.to(values.dtype)


def count_mini_batches(batch: TensorDict, mini_batch_size: int | None,
                       group: dist.ProcessGroup | None = None) -> int:
    """Number of mini-batches of the step: ``ceil(global real samples / mini_batch_size)`` (a collective).

    Args:
        batch: This rank's tensor-only batch ``[B_r, T]``.
        mini_batch_size: Samples per mini-batch over all DP ranks; ``None``: one mini-batch.
        group: The DP group.

    Raises:
        ValueError: ``mini_batch_size < 1``.
    """
    if mini_batch_size is not None and mini_batch_size < 1:
        raise ValueError(f"mini_batch_size must be >= 1 or None, got {mini_batch_size}")
    local = torch.tensor([float(schema.num_real(batch))], dtype=torch.float64)
    global_real = int(all_reduce(local, group)[0])
    return 1 if mini_batch_size is None else max(1, math.ceil(global_real / mini_batch_size))


def split_mini_batches(batch: TensorDict, count: int) -> list[TensorDict]:
    """Split this rank's step batch into the step's ``count`` mini-batches (no communication).

    ``count`` is the step's :func:`count_mini_batches` (the same on every rank); each rank splits its own
    rows into that many contiguous, nearly equal parts. A rank with fewer rows than parts first gets
    ``is_padding`` samples (one token, zero loss mask), so every part is non-empty and every rank runs
    the same number of engine steps.

    Args:
        batch: This rank's tensor-only batch ``[B_r, T]``.
        count: Mini-batches of the step (>= 1).

    Returns:
        The mini-batches of this rank, in order.
    """
    rows = batch.batch_size[0]
    if rows < count:
        batch = schema.append_padding(batch, count - rows)
        rows = count
    return [batch[idx] for idx in torch.tensor_split(torch.arange(rows), count)]
