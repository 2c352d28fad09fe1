"""SequenceBalancing: re-partition a step's samples over data-parallel ranks by workload (SPMD).

On ``on_before_update`` every DP rank holds its own samples (a rank's prompt groups, their advantages
already computed). The callback

1. all-gathers the per-sample ``seq_len`` only (no token data) over the DP group;
2. pads the global batch to the required multiple with synthetic ``is_padding=True`` samples (one
   token each, zero loss mask, a fresh uid each, unique across ranks);
3. computes, identically on every rank, a Karmarkar-Karp partition of the FLOPs workloads
   (``calculate_workload``, h = the module's declared ``hidden_size``:
   the actor model's) into ``dp_size`` equal-count parts;
4. moves samples (a variable-size all-to-all of their real tokens) so that DP rank r holds part r, in
   global (rank-major) order; the synthetic samples are created on the rank they are assigned to.

It logs :func:`~verl_trainer.balancing.log_seqlen_unbalance` metrics. Without the callback no data moves.
GRPO groups may be split across ranks here: advantages are computed before ``on_before_update``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_trainer.balancing import (
    calculate_workload,
    get_seqlen_balanced_partitions,
    log_seqlen_unbalance,
)
from verl_trainer.callbacks.base import Callback
from verl_trainer.data import schema
from verl_trainer.data.exchange import exchange_samples
from verl_trainer.metrics import Metric
from verl_trainer.utils.distributed import all_reduce, is_initialized

if TYPE_CHECKING:
    from verl_trainer.module import TrainingModule
    from verl_trainer.trainer import Trainer


def _all_gather_lengths(lengths: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """All-gather a ``[B_r]`` long tensor whose size differs per rank; returns one tensor per rank."""
    world = dist.get_world_size(group)
    count = torch.tensor([lengths.numel()], dtype=torch.long)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    width = max(int(c) for c in counts)
    padded = torch.zeros(width, dtype=torch.long)
    padded[: lengths.numel()] = lengths
    gathered = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [g[: int(c)] for g, c in zip(gathered, counts)]


def balance_batch(
    batch: TensorDict,
    dp_group: dist.ProcessGroup | None = None,
    hidden_size: int = 4096,
    batch_multiple: int = 1,
    equal_size: bool = True,
    prefix: str = "global_seqlen",
) -> tuple[TensorDict, dict[str, float]]:
    """Re-partition samples over the DP group by workload; collective over ``dp_group``.

    Args:
        batch: This rank's padded batch ``[B_r, T_r]`` (tensor entries; ``input_ids``, ``uid``, and
            ``seq_len`` or ``attention_mask``).
        dp_group: The data-parallel group (``None``: the world).
        hidden_size: Model hidden size for :func:`calculate_workload`.
        batch_multiple: The global batch is padded to a multiple of ``lcm(dp_size, batch_multiple)``
            (:func:`~verl_trainer.balancing.required_batch_multiple`).
        equal_size: Every rank gets the same number of samples (needed for mini-batching).
        prefix: Metric-name prefix.

    Returns:
        ``(new_batch, metrics)``: this rank's part (rank-major global order, synthetic samples last) and
        the balance metrics (identical on every rank).
    """
    world, rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    per_rank = _all_gather_lengths(schema.sequence_lengths(batch), dp_group)
    lengths = torch.cat(per_rank)
    n_real = lengths.numel()
    multiple = math.lcm(world, max(int(batch_multiple), 1))
    n_pad = (-n_real) % multiple
    if n_real + n_pad < world:
        n_pad += multiple  # every rank needs at least one sample
    all_lengths = torch.cat([lengths, torch.ones(n_pad, dtype=torch.long)])
    workloads = calculate_workload(all_lengths, hidden_size=hidden_size)
    parts = get_seqlen_balanced_partitions(workloads.tolist(), world, equal_size)

    owner = torch.empty(n_real + n_pad, dtype=torch.long)
    for r, part in enumerate(parts):
        owner[torch.as_tensor(part, dtype=torch.long)] = r
    offset = sum(p.numel() for p in per_rank[:rank])
    dest = owner[offset : offset + batch.batch_size[0]]
    mine = exchange_samples(batch, dest, group=dp_group)

    if n_pad:  # n_pad is the same on every rank: the all_reduce below is collective
        uid_max = batch[schema.UID].max() if batch.batch_size[0] else torch.tensor(-1)
        uid_max = int(all_reduce(uid_max.to(torch.long).reshape(1), dp_group, dist.ReduceOp.MAX)[0])
        my_pads = torch.as_tensor([i for i in parts[rank] if i >= n_real], dtype=torch.long)
        if my_pads.numel():
            extra = schema.padding_samples(mine, my_pads.numel())
            if schema.UID in mine.keys():  # unique across ranks, not only on this one
                extra.set(schema.UID, (uid_max + 1 + my_pads - n_real).to(mine[schema.UID].dtype))
            mine = torch.cat([schema.with_padding_tag(mine), extra])
    metrics = log_seqlen_unbalance(all_lengths.tolist(), parts, prefix, hidden_size=hidden_size)
    metrics[f"{prefix}/num_padding_samples"] = float(n_pad)
    return mine, metrics


class SequenceBalancing(Callback):
    """Balance per-rank workload before each update (see the module docstring).

    Args:
        hidden_size: Hidden size for the workload model; ``None``: the module's declared
            :attr:`~verl_trainer.module.TrainingModule.hidden_size` (the actor model's).
        batch_multiple: Extra multiple for the global batch size; ``None``: the module's declared
            :attr:`~verl_trainer.module.TrainingModule.required_batch_multiple` (RL: ``lcm(dp,
            actor_mini × n, critic_mini × n)``).
        equal_size: Equal sample counts per rank.
        prefix: Metric-name prefix.
    """

    def __init__(
        self,
        hidden_size: int | None = None,
        batch_multiple: int | None = None,
        equal_size: bool = True,
        prefix: str = "global_seqlen",
    ) -> None:
        self.hidden_size = hidden_size
        self.batch_multiple = batch_multiple
        self.equal_size = equal_size
        self.prefix = prefix
        self.last_metrics: dict[str, float] = {}

    def on_before_update(
        self, trainer: Trainer, module: TrainingModule, batch: TensorDict
    ) -> TensorDict | None:
        """Return this rank's balanced part of the step's global batch; log the balance metrics."""
        if not is_initialized():
            return None
        hidden = self.hidden_size if self.hidden_size is not None else module.hidden_size
        multiple = self.batch_multiple if self.batch_multiple is not None else module.required_batch_multiple
        new_batch, self.last_metrics = balance_batch(
            batch, trainer.dp_group, hidden, multiple, self.equal_size, self.prefix
        )
        trainer.log_metrics({k: Metric.mean(v) for k, v in self.last_metrics.items()})  # same on every rank
        return new_batch
