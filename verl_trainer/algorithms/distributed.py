"""Batch operations of an RL step that must agree over the data-parallel ranks (SPMD).

Every function here is collective over the DP group when one is given (call it on every rank, in the
same order) and reduces only a few numbers; no samples move.

* :func:`global_masked_whiten`: whitening with the mean and variance of the **whole** step batch (all
  DP ranks), so PPO's GAE advantages do not depend on the dp size. verl whitens on its driver, which
  holds the whole batch; here each rank contributes masked sums.
* :func:`drop_samples`: bad samples (a failed reward, a non-finite value) become padding, with their
  whole prompt group under a group estimator, and the count over the DP group is returned.
* :func:`estimator_advantages`: a registered advantage estimator run on this rank's samples, its batch
  whitening (GAE, REINFORCE++) redone over the whole DP batch.
* :func:`split_mini_batches`: the PPO mini-batches of one step; every rank gets the same number of
  non-empty mini-batches (a rank short of samples gets ``is_padding`` samples that train nothing), so no
  rank runs an engine step the others do not.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_trainer.core_algos.advantages import Estimator
from verl_trainer.data import schema
from verl_trainer.utils.distributed import all_reduce

__all__ = [
    "count_mini_batches",
    "drop_samples",
    "estimator_advantages",
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


def estimator_advantages(estimator: Estimator, token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                         group: dist.ProcessGroup | None = None,
                         **available: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` of ``estimator`` on this rank's samples, for any dp size.

    The estimator gets what its signature takes of ``available`` (:meth:`Estimator.__call__`). One that
    whitens over the batch handed in (:attr:`Estimator.whitens`) has that whitening redone over the whole
    DP batch: its returns (REINFORCE++) or ``returns - values`` (GAE), so the advantages equal the
    estimator's on the concatenation of every rank's batch. Collective over ``group`` for those. An
    estimator that reads group ids needs each prompt's group whole on this rank.

    Args:
        estimator: From :func:`~verl_trainer.core_algos.advantages.resolve_estimator`.
        token_level_rewards: ``[B, T]``.
        response_mask: ``[B, T]``.
        group: The DP group (``None``: the default group, if any).
        **available: ``index`` ``[B]``, ``values`` ``[B, T]``, ``reward_baselines`` ``[B]``, ``gamma``,
            ``lam``, ``config``, ``norm_adv_by_std_in_grpo`` (what the recipe can give).

    Returns:
        ``(advantages, returns)``, ``[B, T]``, 0 outside the mask.
    """
    advantages, returns = estimator(token_level_rewards, response_mask, **available)
    mask = response_mask.to(returns.dtype)
    if estimator.whitens == "returns":
        advantages = global_masked_whiten(returns, response_mask, group) * mask
    elif estimator.whitens == "advantages":
        raw = (returns - available["values"]) * mask
        advantages = global_masked_whiten(raw, response_mask, group) * mask
    return advantages, returns


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


def drop_samples(batch: TensorDict, bad: torch.Tensor, group_estimator: bool, group=None
                 ) -> tuple[torch.Tensor, int]:
    """Mark ``bad`` samples (and, for a group estimator, their whole prompt groups) as padding.

    Args:
        batch: This rank's step batch ``[B]`` (``uid``, ``is_padding``), changed in place.
        bad: ``[B]`` bool, the samples to drop on this rank (real ones only).
        group_estimator: Drop every sample that shares a ``uid`` with a bad one (its advantages need the
            whole group).
        group: The DP process group (``None``: the default group, or one process).

    Returns:
        ``([B] bool`` mask of what was dropped here, samples dropped over the DP group``)``.
    """
    drop = bad
    if group_estimator and schema.UID in batch.keys():
        uids = batch[schema.UID]
        drop = torch.isin(uids, uids[bad]) & schema.real_mask(batch)
    schema.mark_padding(batch, drop)
    return drop, int(all_reduce(drop.sum().to(torch.float64), group).item())
