"""The Bradley–Terry reward-model loss the engine calls per micro-batch (``recipes/rm.py``).

A reward model ``r(x, y)`` is a sequence classifier with one label; its score of a sequence is the head at the
last real token. A value-model engine's output at position ``t`` is the head at position ``t - 1``
(``engine/heads.py``), so each row of the batch is the reward model's tokens of prompt + completion followed
by one extra token (:mod:`verl_trainer.data.reward_pairs`) and the score is ``values[i, seq_len_i - 1]`` —
what :class:`~verl_trainer.algorithms.reward_model.RewardModel` reads at inference.

Per pair (Bradley & Terry 1952; Ouyang et al. 2022, arXiv:2203.02155, eq. 1; TRL's ``RewardTrainer``)::

    l = -log sigma(r(x, y_c) - r(x, y_r) - m) + mu * (r(x, y_c) + r(x, y_r))^2

with ``m`` the pair's margin (the batch's ``pair_margin``, 0 when absent; Touvron et al. 2023,
arXiv:2307.09288, eq. 2) and ``mu`` ``center_rewards_coefficient`` (Eisenstein et al. 2023,
arXiv:2312.09244; ``None``: no term). TRL averages both terms over its batch's pairs; here each micro-batch
returns ``sum_pairs l / global_num_groups * dp``
(:func:`~verl_trainer.core_algos.aggregation.agg_group_loss`), so the step's loss is the mean over every
pair of the step whatever the dp size and micro-batching. A pair is the two real rows sharing a
``group_id`` (``preferred`` 1 the chosen, 0 the rejected), kept whole by the balancer and the micro-batcher.

Metrics (declared reductions): ``rm/loss`` (SUM of the partial losses: the step's loss), ``rm/accuracy``
(share of pairs with ``r_c > r_r``; a tie counts wrong, as TRL), ``rm/margin`` (mean ``r_c - r_r``),
``rm/rewards_chosen``, ``rm/rewards_rejected`` (mean scores), each a MEAN weighted by the pairs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from verl_trainer.core_algos.aggregation import GlobalBatchInfo, agg_group_loss
from verl_trainer.core_algos.preference import _pairs
from verl_trainer.data import schema
from verl_trainer.data.reward_pairs import PAIR_MARGIN
from verl_trainer.metrics import Metric

if TYPE_CHECKING:
    from tensordict import TensorDict

__all__ = ["RewardLossConfig", "RewardModelLoss", "bradley_terry_losses", "sequence_scores"]

@dataclass(frozen=True)
class RewardLossConfig:
    """Coefficients of the Bradley–Terry loss (TRL's ``RewardConfig`` names).

    Attributes:
        center_rewards_coefficient: ``mu`` of the centring term ``mu (r_c + r_r)^2``; ``None``: off.
    """

    center_rewards_coefficient: float | None = None

    def __post_init__(self) -> None:
        mu = self.center_rewards_coefficient
        if mu is not None and not mu >= 0:
            raise ValueError(f"algorithm.loss.center_rewards_coefficient={mu!r} must be >= 0 or null (off); "
                             "TRL's suggestion is 0.01")


def bradley_terry_losses(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None,
                         center_rewards_coefficient: float | None = None) -> torch.Tensor:
    """Per-pair losses ``[p]`` (module docstring) from the scores ``[p]`` of the chosen and rejected rows."""
    diff = chosen - rejected
    if margin is not None:
        diff = diff - margin.to(diff.dtype)
    losses = -F.logsigmoid(diff)
    if center_rewards_coefficient is not None:
        losses = losses + center_rewards_coefficient * (chosen + rejected) ** 2
    return losses


def sequence_scores(values: torch.Tensor, data: TensorDict | Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``[B]`` each row's score ``values[i, seq_len_i - 1]``: the head at its last real token.

    The row ends with the extra score token (module docstring).

    Raises:
        KeyError: The batch has no ``seq_len``.
    """
    if schema.SEQ_LEN not in data.keys():
        raise KeyError("the reward-model loss needs 'seq_len' in the batch (build batches with "
                       "verl_trainer.data.reward_pairs)")
    last = (data[schema.SEQ_LEN].to(values.device) - 1).clamp_min(0)
    return values[torch.arange(values.shape[0], device=values.device), last]


class RewardModelLoss:
    """The engine loss of the Bradley–Terry objective (module docstring).

    Args:
        config: See :class:`RewardLossConfig`.
    """

    def __init__(self, config: RewardLossConfig | None = None) -> None:
        self.config = config if config is not None else RewardLossConfig()

    def __call__(self, model_output: Mapping[str, torch.Tensor],
                 data: TensorDict | Mapping[str, torch.Tensor],
                 info: GlobalBatchInfo | None = None) -> tuple[torch.Tensor, dict[str, Metric]]:
        """Partial loss and metrics of one micro-batch (``model_output["values"]`` ``[b, T]``).

        Raises:
            ValueError: A ``group_id`` without exactly one chosen and one rejected real row here.
        """
        info = GlobalBatchInfo.from_batch(data) if info is None else info
        scores = sequence_scores(model_output["values"], data).float()
        c, r = _pairs(data)
        margin = data[PAIR_MARGIN][c].to(scores.device) if PAIR_MARGIN in data.keys() else None
        losses = bradley_terry_losses(scores[c], scores[r], margin, self.config.center_rewards_coefficient)
        loss = agg_group_loss(losses, info.global_num_groups, info.dp_size)
        chosen, rejected = scores[c].detach(), scores[r].detach()
        n = torch.tensor(c.numel())
        metrics = {
            "rm/loss": Metric.sum(loss.detach()),
            "rm/accuracy": _mean((chosen > rejected).float(), n),
            "rm/margin": _mean(chosen - rejected, n),
            "rm/rewards_chosen": _mean(chosen, n),
            "rm/rewards_rejected": _mean(rejected, n),
        }
        return loss, metrics


def _mean(values: torch.Tensor, count: torch.Tensor) -> Metric:
    """The mean of ``values`` ``[n]`` weighted by ``n``: reduced, the mean over the step's pairs."""
    total = values.sum()
    return Metric.mean(total / count.clamp_min(1).to(total.dtype), weight=count)
