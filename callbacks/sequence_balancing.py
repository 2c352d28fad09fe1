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

It logs :func:`~verl_trainer.core_algos.balancing.log_seqlen_unbalance` metrics. Without the callback no data
moves.
GRPO groups may be split across ranks here: advantages are computed before ``on_before_update``.
"""

from __future__ import annotations

from typing import Any

from tensordict import TensorDict

from verl_trainer.callbacks.base import Callback
from verl_trainer.callbacks.contract import CallbackModule, CallbackTrainer
from verl_trainer.core_algos.balancing import balance_batch
from verl_trainer.metrics import Metric
from verl_trainer.utils.distributed import is_initialized

__all__ = ["SequenceBalancing", "balance_batch"]


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
        self._run: tuple[Any, int, int] | None = None  # (dp group, hidden size, multiple) of the fit

    def on_fit_start(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Read the run's DP group and the module's declared sizes once: they hold for the whole fit."""
        self._run = self._resolve(trainer, module) if is_initialized() else None

    def _resolve(self, trainer: CallbackTrainer, module: CallbackModule) -> tuple[Any, int, int]:
        hidden = self.hidden_size if self.hidden_size is not None else module.hidden_size
        multiple = self.batch_multiple if self.batch_multiple is not None else module.required_batch_multiple
        return trainer.dp_group, hidden, multiple

    def on_before_update(
        self, trainer: CallbackTrainer, module: CallbackModule, batch: TensorDict
    ) -> TensorDict | None:
        """Return this rank's balanced part of the step's global batch; log the balance metrics."""
        if not is_initialized():
            return None
        dp_group, hidden, multiple = self._run or self._resolve(trainer, module)
        new_batch, self.last_metrics = balance_batch(batch, dp_group, hidden, multiple, self.equal_size,
                                                     self.prefix)
        trainer.log_metrics({k: Metric.mean(v) for k, v in self.last_metrics.items()})  # same on every rank
        return new_batch
