"""Preference-optimisation objectives as pure functions of sequence log-probabilities.

Each function takes one value per pair (or per sample for KTO), ``[p]``, and returns the per-pair (per-sample)
losses and the implicit rewards TRL logs. Notation: ``c`` the chosen, ``r`` the rejected completion,
``log pi(y|x)`` the summed log-probability of the completion's tokens under the policy, ``log pi_ref`` under
the reference, ``|y|`` its token count, ``beta`` the temperature, ``eps`` the label-smoothing rate,
``h = (log pi(c) - log pi_ref(c)) - (log pi(r) - log pi_ref(r))`` the DPO margin.

* ``sigmoid`` (DPO, Rafailov et al. 2023, arXiv:2305.18290, eq. 7; with ``eps > 0`` conservative DPO,
  Mitchell 2023, "A note on DPO with noisy preferences"):
  ``-(1 - eps) log sigma(beta h) - eps log sigma(-beta h)``.
* ``ipo`` (Azar et al. 2023, arXiv:2310.12036, eq. 17; the log-ratios divided by ``|y|`` as TRL does):
  ``((lr(c) / |c| - lr(r) / |r|) - 1 / (2 beta))^2`` with ``lr(y) = log pi(y) - log pi_ref(y)``.
* ``robust`` (Chowdhury et al. 2024, arXiv:2403.00409, eq. 12, unbiased under label flips at rate eps):
  ``(-(1 - eps) log sigma(beta h) + eps log sigma(-beta h)) / (1 - 2 eps)``.
* ``simpo`` (Meng et al. 2024, arXiv:2405.14734, eq. 6; reference-free, length-normalised):
  ``-(1 - eps) log sigma(beta m) - eps log sigma(-beta m)``, ``m = avg(c) - avg(r) - gamma / beta``,
  ``avg(y) = log pi(y) / |y|``.
* ``orpo`` (Hong et al. 2024, arXiv:2403.07691, eqs. 2, 4-7; reference-free):
  ``-avg(c) - lambda log sigma(log odds(c) - log odds(r))``, ``log odds(y) = avg(y) - log(1 - exp(avg(y)))``;
  ``lambda`` is ``beta`` (TRL's name). The NLL term is the paper's: the chosen completion's tokens,
  averaged per sequence. TRL's ORPOTrainer instead averages the NLL over the prompt and completion tokens
  of its batch; the odds-ratio term and the rewards are the same.
* ``kto`` (Ethayarajh et al. 2024, arXiv:2402.01306, eq. 7): per sample, desirable
  ``w_d (1 - sigma(beta (lr(y) - z0)))``, undesirable ``w_u (1 - sigma(beta (z0 - lr(y))))``, with ``z0``
  the KL reference point (:func:`kto_reference_point`).

Rewards: ``beta * lr(y)`` (``sigmoid``, ``ipo``, ``robust``, ``kto``), ``beta * avg(y)`` (``simpo``,
``orpo``), as TRL's DPO, CPO, ORPO and KTO trainers log them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = [
    "PAIR_LOSS_TYPES", "PREFERENCE_LOSS_TYPES", "REFERENCE_FREE_LOSS_TYPES", "PairLosses", "kto_losses",
    "kto_reference_point", "log1mexp", "orpo_log_odds", "pair_losses",
]

PAIR_LOSS_TYPES = ("sigmoid", "ipo", "robust", "simpo", "orpo")
"""Objectives over (chosen, rejected) pairs."""
PREFERENCE_LOSS_TYPES = (*PAIR_LOSS_TYPES, "kto")
"""Every ``loss_type``."""
REFERENCE_FREE_LOSS_TYPES = ("simpo", "orpo")
"""Objectives without a reference model."""


class PairLosses(NamedTuple):
    """Per-pair (or per-sample) losses and the implicit rewards, each ``[p]``."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, accurate at both ends (Maechler 2012)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_log_odds(avg_chosen: torch.Tensor, avg_rejected: torch.Tensor) -> torch.Tensor:
    """ORPO's ``log odds(c) - log odds(r)`` from mean token log-probs ``[p]`` (Hong et al. 2024, eq. 4)."""
    return (avg_chosen - avg_rejected) - (log1mexp(avg_chosen) - log1mexp(avg_rejected))


def _smoothed_logistic(logits: torch.Tensor, eps: float) -> torch.Tensor:
    return -(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)


def pair_losses(loss_type: str, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor,
                chosen_ref_logps: torch.Tensor | None, rejected_ref_logps: torch.Tensor | None,
                chosen_len: torch.Tensor, rejected_len: torch.Tensor, beta: float,
                label_smoothing: float = 0.0, simpo_gamma: float = 0.5) -> PairLosses:
    """Losses and rewards of ``p`` pairs under one of :data:`PAIR_LOSS_TYPES` (formulas: module docstring).

    Args:
        loss_type: One of :data:`PAIR_LOSS_TYPES`.
        chosen_logps: ``[p]`` summed completion log-probs of the chosen completions under the policy.
        rejected_logps: ``[p]`` the same for the rejected completions.
        chosen_ref_logps: ``[p]`` the chosen ones under the reference (``None`` for the reference-free
            ``simpo`` / ``orpo``).
        rejected_ref_logps: ``[p]`` the rejected ones under the reference (or ``None``).
        chosen_len: ``[p]`` chosen completion token counts.
        rejected_len: ``[p]`` rejected completion token counts.
        beta: Temperature (ORPO: the odds-ratio weight lambda).
        label_smoothing: ``eps`` of ``sigmoid``, ``robust`` and ``simpo``.
        simpo_gamma: SimPO's target margin ``gamma``.

    Raises:
        ValueError: An unknown ``loss_type``, or no reference log-probs for one that needs them.
    """
    if loss_type in REFERENCE_FREE_LOSS_TYPES:
        avg_c = chosen_logps / chosen_len.clamp_min(1).to(chosen_logps.dtype)
        avg_r = rejected_logps / rejected_len.clamp_min(1).to(rejected_logps.dtype)
        if loss_type == "simpo":
            losses = _smoothed_logistic(beta * (avg_c - avg_r - simpo_gamma / beta), label_smoothing)
        else:
            losses = -avg_c - beta * F.logsigmoid(orpo_log_odds(avg_c, avg_r))
        return PairLosses(losses, beta * avg_c.detach(), beta * avg_r.detach())
    if loss_type not in PAIR_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}; choose one of {', '.join(PAIR_LOSS_TYPES)} (or 'kto')")
    if chosen_ref_logps is None or rejected_ref_logps is None:
        raise ValueError(f"loss_type={loss_type!r} needs the reference log-probs (ref_log_prob)")
    lr_c, lr_r = chosen_logps - chosen_ref_logps, rejected_logps - rejected_ref_logps
    if loss_type == "sigmoid":
        losses = _smoothed_logistic(beta * (lr_c - lr_r), label_smoothing)
    elif loss_type == "robust":
        h = beta * (lr_c - lr_r)
        losses = (-(1 - label_smoothing) * F.logsigmoid(h) + label_smoothing * F.logsigmoid(-h)) / (
            1 - 2 * label_smoothing)
    else:  # ipo
        n_c, n_r = chosen_len.clamp_min(1).to(lr_c.dtype), rejected_len.clamp_min(1).to(lr_r.dtype)
        delta = lr_c / n_c - lr_r / n_r
        losses = (delta - 1 / (2 * beta)) ** 2
    return PairLosses(losses, beta * lr_c.detach(), beta * lr_r.detach())


def kto_reference_point(kl_logps: torch.Tensor, kl_ref_logps: torch.Tensor) -> torch.Tensor:
    """KTO's ``z0`` from mismatched (prompt, completion) samples: ``max(0, mean(log pi - log pi_ref))``.

    TRL's estimate (KTOTrainer): the completions of a batch rotated by one over its prompts, their summed
    log-ratio averaged over the batch (all ranks), clamped at 0 and detached. With several ranks or
    micro-batches, average the sums globally first and pass the mean here (``[1]``).
    """
    return (kl_logps - kl_ref_logps).mean().clamp(min=0).detach()


def kto_losses(logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor,
               reference_point: torch.Tensor | float, beta: float, desirable_weight: float = 1.0,
               undesirable_weight: float = 1.0) -> PairLosses:
    """Per-sample KTO losses (module docstring) and rewards ``beta * lr(y)``, each ``[n]``.

    Args:
        logps: ``[n]`` summed completion log-probs under the policy.
        ref_logps: ``[n]`` under the reference.
        desirable: ``[n]`` bool, the sample's label.
        reference_point: ``z0`` (:func:`kto_reference_point`), detached.
        beta: Temperature.
        desirable_weight: ``w_d``.
        undesirable_weight: ``w_u``.

    Returns:
        ``PairLosses(losses, rewards, rewards)``: the same reward tensor twice; select by ``desirable``.
    """
    lr = logps - ref_logps
    good = torch.as_tensor(desirable, device=lr.device).bool()
    z0 = torch.as_tensor(reference_point, dtype=lr.dtype, device=lr.device)
    losses = torch.where(good, desirable_weight * (1 - torch.sigmoid(beta * (lr - z0))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (z0 - lr))))
    rewards = beta * lr.detach()
    return PairLosses(losses, rewards, rewards)
