"""Online DPO: preference pairs sampled from the policy, labelled by a reward function or a reward model.

The RL loop (:class:`~verl_trainer.algorithms.rl.RLModule`) with the preference loss in place of the policy
loss (Guo et al. 2024, arXiv:2402.04792; TRL's ``OnlineDPOTrainer`` labels with a judge or reward model;
here with the scores of ``algorithm.reward``: functions, a reward model, or both). Everything else is the RL
loop's own: the rollout (HF or vLLM, weight sync), scoring (``reward.name``, ``reward.model``), the
reference log-probs, SequenceBalancing, validation (``val/reward/*``) and the non-finite guard. A step::

    rollout (n >= 2 responses per prompt) -> score -> select pairs (select_online_pairs)
      -> reference log-probs -> on_before_update -> actor.train_batch(pairs, preference_loss)

For each prompt the highest-scored response is ``chosen`` and the lowest ``rejected`` (the first of equal
ones, in sampling order). **Ties**: a prompt whose responses all score the same has no preference; it is
dropped and counted (``online_dpo/tied_prompt_frac``). When every prompt of the step on every rank ties, the
update is skipped on all ranks together. The pair's two rows share a ``group_id`` (unique over the DP
group), so balancing and micro-batching keep them whole and the loss is the mean over the step's pairs
(:mod:`verl_trainer.core_algos.preference`). The step is one mini-batch (``actor.ppo_epochs`` passes).

Logged besides the RL loop's: the preference loss's metrics (``pref/loss``, ``rewards/accuracies``,
``rewards/margins``, ...), ``online_dpo/pairs`` (SUM: the step's pairs), ``online_dpo/tied_prompt_frac``
(MEAN over prompts), ``online_dpo/score_gap`` (MEAN over pairs of chosen - rejected score).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_trainer.algorithms.config import RLConfig
from verl_trainer.algorithms.rl import RLModule
from verl_trainer.algorithms.stages import StepMetrics
from verl_trainer.algorithms.stages.signal import ComputePart, SelectPart
from verl_trainer.core_algos.preference import PreferenceLossConfig, preference_loss
from verl_trainer.data import schema
from verl_trainer.metrics import Metric
from verl_trainer.rollout.config import RolloutConfig
from verl_trainer.utils.distributed import all_reduce

__all__ = ["OnlineDPO", "OnlineDPOConfig", "OnlinePairs", "select_online_pairs"]


@dataclass
class OnlineDPOConfig(RLConfig):
    """The RL loop's settings plus the preference objective.

    Attributes:
        rollout: As the RL loop's, ``n >= 2`` (default 4).
        loss: The pair objective (``sigmoid``, ``ipo``, ``robust``, ``simpo``, ``orpo``) and its coefficients:
            :class:`~verl_trainer.core_algos.preference.PreferenceLossConfig`. ``actor.loss`` (the policy
            loss's settings) is not read.
    """

    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(n=4))
    loss: PreferenceLossConfig = field(default_factory=PreferenceLossConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rollout.n < 2:
            raise ValueError(f"algorithm.rollout.n={self.rollout.n}: online DPO pairs the best and the worst "
                             "of each prompt's responses; set algorithm.rollout.n >= 2")
        if not self.loss.paired:
            raise ValueError(f"algorithm.loss.loss_type={self.loss.loss_type!r} is unpaired; online DPO "
                             "builds pairs: choose sigmoid, ipo, robust, simpo or orpo")
        if self.rollout.max_staleness:
            raise ValueError(f"algorithm.rollout.max_staleness={self.rollout.max_staleness}: the preference "
                             "loss has no importance correction for responses of older weights; set it to 0")
        if self.actor.loss.use_kl_loss:
            raise ValueError("algorithm.actor.loss.use_kl_loss=true: online DPO's loss is the preference "
                             "loss (its reference is in algorithm.loss); set use_kl_loss=false")


class OnlinePairs:
    """The advantages stage's selection part: :func:`select_online_pairs` (a collective).

    Args:
        dp_group: The DP group.
        dp_size: Its size.
        dp_rank: This rank's place in it.
    """

    def __init__(self, dp_group: dist.ProcessGroup | None = None, dp_size: int = 1, dp_rank: int = 0) -> None:
        self.dp_group = dp_group
        self.dp_size = dp_size
        self.dp_rank = dp_rank

    def __call__(self, batch: TensorDict, scores: torch.Tensor,
                 metrics: StepMetrics) -> tuple[TensorDict, bool]:
        """``(pairs, any_pair)``; adds the ``online_dpo/*`` metrics."""
        pairs, any_pair, pair_metrics = select_online_pairs(batch, scores, self.dp_group, self.dp_size,
                                                           self.dp_rank)
        metrics.update(pair_metrics)
        return pairs, any_pair


def select_online_pairs(batch: TensorDict, scores: torch.Tensor, group: dist.ProcessGroup | None = None,
                        dp_size: int = 1, dp_rank: int = 0) -> tuple[TensorDict, bool, dict[str, Metric]]:
    """Each prompt's best and worst response as a pair; tied prompts dropped (module docstring).

    Collective over ``group`` (one all-reduce of ``dp_size`` numbers).

    Args:
        batch: This rank's tensor-only step batch ``[B]`` (``uid``: a prompt's responses share it, all on
            this rank; ``is_padding`` optional).
        scores: ``[B]`` the responses' rewards.
        group: The DP group.
        dp_size: Its size.
        dp_rank: This rank's place in it.

    Returns:
        ``(pairs, any_pair, metrics)``: this rank's pairs ``[2P]`` (row ``2p`` chosen, ``preferred = 1``;
        ``2p + 1`` rejected; ``group_id`` unique over the DP group; one ``is_padding`` row when ``P = 0``),
        whether any rank has a pair (the same on every rank), and the ``online_dpo/*`` metrics.
    """
    real = schema.real_mask(batch)
    uids = batch[schema.UID]
    chosen, rejected, gaps = [], [], []
    prompts = torch.unique(uids[real]).tolist()
    values = scores.to(torch.float64)
    for uid in prompts:
        rows = torch.nonzero(real & (uids == uid)).view(-1)
        best = rows[int(torch.argmax(values[rows]))]
        worst = rows[int(torch.argmin(values[rows]))]
        if values[best] > values[worst]:
            chosen.append(int(best))
            rejected.append(int(worst))
            gaps.append(float(values[best] - values[worst]))
    n = len(chosen)
    counts = torch.zeros(max(dp_size, 1), dtype=torch.long)
    rank = dp_rank if dp_size > 1 else 0
    counts[rank] = n
    counts = all_reduce(counts, group) if dp_size > 1 else counts
    if n:
        order = torch.tensor([i for pair in zip(chosen, rejected) for i in pair])
        pairs = batch[order]
        pairs.set(schema.GROUP_ID, torch.arange(n).repeat_interleave(2) + int(counts[:rank].sum()))
        pairs.set(schema.PREFERRED, torch.tensor([1.0, 0.0] * n))
    else:
        pairs = schema.padding_samples(batch, 1)
        pairs.set(schema.GROUP_ID, torch.zeros(1, dtype=torch.long))
        pairs.set(schema.PREFERRED, torch.zeros(1))
    num_prompts = len(prompts)
    metrics = {
        "online_dpo/pairs": Metric.sum(float(n) * dp_size),
        "online_dpo/tied_prompt_frac": Metric.mean((num_prompts - n) / max(num_prompts, 1),
                                                   weight=num_prompts),
        "online_dpo/score_gap": Metric.mean(sum(gaps) / max(n, 1), weight=n),
    }
    return pairs, int(counts.sum()) > 0, metrics


class OnlineDPO(RLModule):
    """Online DPO (see the module docstring).

    Args:
        config: See :class:`OnlineDPOConfig`.

    Raises:
        TypeError: ``config`` is not an :class:`OnlineDPOConfig`.
    """

    config: OnlineDPOConfig

    def __init__(self, config: OnlineDPOConfig) -> None:
        if not isinstance(config, OnlineDPOConfig):
            raise TypeError(f"OnlineDPO needs an OnlineDPOConfig, got {type(config).__name__}")
        super().__init__(config)
        self.actor_loss = preference_loss(config.loss)

    @property
    def uses_reference(self) -> bool:
        """Whether the objective reads reference log-probs (all pair losses but SimPO and ORPO)."""
        return self.config.loss.needs_reference

    @property
    def mini_batch_samples(self) -> int | None:
        """One mini-batch per step: a pair must not be split between two."""
        return None

    def compute_advantages(self, batch: TensorDict, scores: torch.Tensor, metrics: StepMetrics) -> None:
        """No advantages: the pairs carry the signal (zeros, so the guard's checks read a finite field)."""
        batch[schema.ADVANTAGES] = torch.zeros_like(batch[schema.RESPONSE_MASK], dtype=torch.float32)

    def advantage_parts(self) -> tuple[ComputePart, SelectPart]:
        """:meth:`compute_advantages` and :class:`OnlinePairs`."""
        topo = self.topology
        dp, rank = (topo.dp_size, topo.dp_rank) if topo is not None else (1, 0)
        return self.compute_advantages, OnlinePairs(self._dp_group, dp, rank)
