"""The preference loss the engine calls per micro-batch: DPO, IPO, cDPO / robust DPO, SimPO, ORPO and KTO.

Formulas and sources: :mod:`verl_trainer.core_algos.preference_losses`. This module reads a micro-batch
(the contract of :mod:`verl_trainer.core_algos.aggregation`), forms the sequence log-probabilities, and
aggregates with the step's global denominators:

* pair objectives: one term per pair, ``sum_pairs l / global_num_groups * dp``
  (:func:`~verl_trainer.core_algos.aggregation.agg_group_loss`); a pair is the two real samples sharing a
  ``group_id``, ``preferred = 1`` the chosen, ``0`` the rejected; both must be in the micro-batch (the
  balancer and the micro-batcher keep a group together);
* ``kto``: one term per real sample, ``sum_i l_i / global_batch_size * dp``; the reference point ``z0`` is
  the batch's ``kl_reference`` (the module estimates it over the whole step before the update).

Sequence log-probabilities are the sums of ``log_probs`` (and ``ref_log_prob``) over ``loss_mask`` (the
completion tokens); ``|y|`` is the ``loss_mask`` count.

Metrics (TRL's names): ``pref/loss`` (SUM), ``rewards/chosen``, ``rewards/rejected``, ``logps/chosen``,
``logps/rejected`` (means over the step's chosen / rejected completions); pairs also ``rewards/margins``
and ``rewards/accuracies`` (means over pairs); ORPO also ``orpo/log_odds_ratio``, ``orpo/log_odds_chosen``
and ``orpo/nll_loss``; KTO also ``kto/kl`` (the reference point).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from verl_trainer.core_algos.aggregation import (
    GlobalBatchInfo,
    agg_group_loss,
    agg_loss,
    masked_sum,
)
from verl_trainer.core_algos.preference_losses import (
    PAIR_LOSS_TYPES,
    PREFERENCE_LOSS_TYPES,
    REFERENCE_FREE_LOSS_TYPES,
    kto_losses,
    orpo_log_odds,
    pair_losses,
)
from verl_trainer.data import schema
from verl_trainer.metrics import Metric

if TYPE_CHECKING:
    from tensordict import TensorDict

__all__ = ["PreferenceLoss", "PreferenceLossConfig", "preference_loss"]

LossOutput = tuple[torch.Tensor, dict[str, Metric]]
SMOOTHED = ("sigmoid", "robust", "simpo")
"""The objectives that read ``label_smoothing``."""


@dataclass(frozen=True)
class PreferenceLossConfig:
    """Which preference objective and its coefficients (TRL's names and defaults).

    Attributes:
        loss_type: ``sigmoid`` (DPO; cDPO with ``label_smoothing > 0``), ``ipo``, ``robust``, ``simpo``,
            ``orpo`` or ``kto``.
        beta: Temperature (ORPO: the odds-ratio weight lambda). TRL: 0.1.
        label_smoothing: ``eps`` in ``[0, 0.5)`` (``sigmoid``, ``robust``, ``simpo`` only).
        simpo_gamma: SimPO's target reward margin gamma (TRL: 0.5).
        desirable_weight: KTO's ``w_d``.
        undesirable_weight: KTO's ``w_u``.
    """

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.loss_type not in PREFERENCE_LOSS_TYPES:
            raise ValueError(f"algorithm.loss.loss_type={self.loss_type!r}; choose one of "
                             f"{', '.join(PREFERENCE_LOSS_TYPES)}")
        if not self.beta > 0:
            raise ValueError(f"algorithm.loss.beta={self.beta!r} must be > 0 (TRL's default 0.1)")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"algorithm.loss.label_smoothing={self.label_smoothing!r} must be in [0, 0.5)")
        if self.label_smoothing and self.loss_type not in SMOOTHED:
            raise ValueError(f"algorithm.loss.label_smoothing={self.label_smoothing} has no effect with "
                             f"loss_type={self.loss_type!r}; it is read by {', '.join(SMOOTHED)}: set it "
                             "to 0")
        for name in ("desirable_weight", "undesirable_weight"):
            if not getattr(self, name) > 0:
                raise ValueError(f"algorithm.loss.{name}={getattr(self, name)!r} must be > 0")

    @property
    def needs_reference(self) -> bool:
        """Whether the objective reads reference log-probs (all but SimPO and ORPO)."""
        return self.loss_type not in REFERENCE_FREE_LOSS_TYPES

    @property
    def paired(self) -> bool:
        """Whether the data are (chosen, rejected) pairs (all but KTO)."""
        return self.loss_type in PAIR_LOSS_TYPES


def _field(source: TensorDict | Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in source.keys():
        present = sorted(map(str, source.keys()))
        raise KeyError(f"preference_loss needs {key!r} in the batch; present: {present} (build batches "
                       "with verl_trainer.data.preference)")
    return source[key]


def _real(data: TensorDict | Mapping[str, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """``[b]`` bool: the real (not ``is_padding``) samples."""
    if schema.IS_PADDING in data.keys():
        return ~data[schema.IS_PADDING].bool()
    return torch.ones(like.shape[0], dtype=torch.bool, device=like.device)


def _pairs(data: TensorDict | Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices ``[p]`` of the chosen and the rejected sample of each pair, matched by ``group_id``.

    Raises:
        ValueError: A pair without exactly one chosen and one real rejected sample here.
    """
    group = _field(data, schema.GROUP_ID)
    real = _real(data, group)
    preferred = _field(data, schema.PREFERRED) > 0.5
    chosen = torch.nonzero(real & preferred).view(-1)
    rejected = torch.nonzero(real & ~preferred).view(-1)
    chosen = chosen[torch.argsort(group[chosen], stable=True)]
    rejected = rejected[torch.argsort(group[rejected], stable=True)]
    ok = chosen.numel() == rejected.numel() and torch.equal(group[chosen], group[rejected])
    if not ok or torch.unique(group[chosen]).numel() != chosen.numel():
        counts = {int(g): [int((group[chosen] == g).sum()), int((group[rejected] == g).sum())]
                  for g in torch.unique(group[real])}
        broken = {g: c for g, c in counts.items() if c != [1, 1]}
        raise ValueError(
            "preference_loss: each group_id needs exactly one chosen and one rejected sample in a "
            f"micro-batch; group_id -> [chosen, rejected] here: {broken}. Keep a pair's two rows together "
            "(the balancer and the micro-batcher do when the batch has group_id; do not split a batch by "
            "rows)"
        )
    return chosen, rejected


class PreferenceLoss:
    """The engine loss of a :class:`PreferenceLossConfig` (module docstring); see :func:`preference_loss`."""

    def __init__(self, config: PreferenceLossConfig) -> None:
        self.config = config

    def __call__(self, model_output: Mapping[str, torch.Tensor],
                 data: TensorDict | Mapping[str, torch.Tensor],
                 info: GlobalBatchInfo | None = None) -> LossOutput:
        """Partial loss and metrics of one micro-batch."""
        cfg = self.config
        info = GlobalBatchInfo.from_batch(data) if info is None else info
        mask = _field(data, schema.LOSS_MASK).bool()
        logps = masked_sum(model_output["log_probs"], mask, -1)
        ref = masked_sum(_field(data, schema.REF_LOG_PROB), mask, -1) if cfg.needs_reference else None
        lengths = mask.sum(-1)
        if cfg.paired:
            return self._pairs(data, logps, ref, lengths, info)
        return self._kto(data, logps, ref, info)

    def _pairs(self, data: TensorDict | Mapping[str, torch.Tensor], logps: torch.Tensor,
               ref: torch.Tensor | None, lengths: torch.Tensor, info: GlobalBatchInfo) -> LossOutput:
        cfg = self.config
        c, r = _pairs(data)
        out = pair_losses(cfg.loss_type, logps[c], logps[r], None if ref is None else ref[c],
                          None if ref is None else ref[r], lengths[c], lengths[r], cfg.beta,
                          cfg.label_smoothing, cfg.simpo_gamma)
        loss = agg_group_loss(out.losses, info.global_num_groups, info.dp_size)
        n = torch.tensor(c.numel())
        metrics = {
            "pref/loss": Metric.sum(loss.detach()),
            "rewards/chosen": _mean(out.chosen_rewards, n),
            "rewards/rejected": _mean(out.rejected_rewards, n),
            "rewards/margins": _mean(out.chosen_rewards - out.rejected_rewards, n),
            "rewards/accuracies": _mean((out.chosen_rewards > out.rejected_rewards).float(), n),
            "logps/chosen": _mean(logps[c].detach(), n),
            "logps/rejected": _mean(logps[r].detach(), n),
        }
        if cfg.loss_type == "orpo":
            avg_c = logps[c].detach() / lengths[c].clamp_min(1)
            avg_r = logps[r].detach() / lengths[r].clamp_min(1)
            log_odds = orpo_log_odds(avg_c, avg_r)
            metrics["orpo/log_odds_ratio"] = _mean(torch.nn.functional.logsigmoid(log_odds), n)
            metrics["orpo/log_odds_chosen"] = _mean(log_odds, n)
            metrics["orpo/nll_loss"] = _mean(-avg_c, n)
        return loss, metrics

    def _kto(self, data: TensorDict | Mapping[str, torch.Tensor], logps: torch.Tensor, ref: torch.Tensor,
             info: GlobalBatchInfo) -> LossOutput:
        cfg = self.config
        real = _real(data, logps)
        if schema.KL_SAMPLE in data.keys() and bool((data[schema.KL_SAMPLE].bool() & real).any()):
            raise ValueError("preference_loss (kto): the batch holds KL samples (kl_sample=True); the module "
                             "estimates the reference point from them and trains on the others only")
        good = _field(data, schema.PREFERRED) > 0.5
        z0 = _field(data, schema.KL_REFERENCE)
        z0 = z0[0] if z0.numel() else torch.zeros(())
        out = kto_losses(logps, ref, good, z0, cfg.beta, cfg.desirable_weight, cfg.undesirable_weight)
        loss = agg_loss(out.losses[:, None], real[:, None], "seq-mean-token-sum", info.dp_size,
                        global_batch_size=info.global_batch_size)
        chosen, rejected = real & good, real & ~good
        metrics = {
            "pref/loss": Metric.sum(loss.detach()),
            "rewards/chosen": _mean(out.chosen_rewards[chosen], chosen.sum()),
            "rewards/rejected": _mean(out.rejected_rewards[rejected], rejected.sum()),
            "logps/chosen": _mean(logps[chosen].detach(), chosen.sum()),
            "logps/rejected": _mean(logps[rejected].detach(), rejected.sum()),
            "kto/kl": Metric.mean(float(z0)),
        }
        return loss, metrics


def _mean(values: torch.Tensor, count: torch.Tensor) -> Metric:
    """The mean of ``values`` ``[n]`` weighted by ``n``: reduced, the mean over the step's elements."""
    total = values.detach().sum()
    return Metric.mean(total / count.clamp_min(1).to(total.dtype), weight=count)


def preference_loss(config: PreferenceLossConfig | None = None) -> PreferenceLoss:
    """Build the preference loss for the engine from ``config`` (default: DPO sigmoid, beta 0.1)."""
    return PreferenceLoss(config if config is not None else PreferenceLossConfig())
