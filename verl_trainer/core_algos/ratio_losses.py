"""Policy losses that reshape the token ratio: GSPO-token, CISPO, SAPO and DPPO (Binary-TV, Binary-KL).

Each has the policy-loss signature of :mod:`verl_trainer.core_algos.policy_losses`, aggregates through
:func:`~verl_trainer.core_algos.aggregation.agg_loss` with the step's global denominators and is
registered under verl's name. Notation: ``r_t = pi/pi_old`` of token ``t`` (log-ratio clamped to
[-20, 20]), ``A_t`` its advantage, ``sg`` stop-gradient, ``eps_low`` / ``eps_high`` = ``clip_ratio_low`` /
``clip_ratio_high`` (each defaulting to ``clip_ratio``).
"""

from __future__ import annotations

from typing import Any

import torch

from verl_trainer.core_algos.aggregation import (
    SEQ_MEAN_TOKEN_MEAN,
    TOKEN_MEAN,
    agg_loss,
    masked_sum,
)
from verl_trainer.core_algos.policy_losses import agg_kwargs, clip_range, config_get, register_policy_loss
from verl_trainer.metrics import Metric

LossOutput = tuple[torch.Tensor, dict[str, Metric]]



def _log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    return torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)


def _weighted(pg_losses: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    return pg_losses if rollout_is_weights is None else pg_losses * rollout_is_weights


@register_policy_loss("gspo_token")
def compute_policy_loss_gspo_token(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = SEQ_MEAN_TOKEN_MEAN,
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: Any = None,
) -> LossOutput:
    """GSPO-token (Zheng et al. 2025, arXiv:2507.18071, Eq. 13): the sequence ratio with token advantages.

    ``s_{i,t} = sg[s_i] * pi_t / sg[pi_t]`` with ``s_i = exp(mean_t log r_t)`` (value ``s_i``, gradient of
    the token's own log-prob; log clamped at 10), ``l_t = max(-A_t s_{i,t}, -A_t clip(s_{i,t}, 1 - eps_low,
    1 + eps_high))``, aggregated ``seq-mean-token-mean`` (the paper's ``1/|y_i|``): verl's ``gspo``
    function. With advantages constant over each sequence it equals ``gspo`` (the sequence variant) in
    value and gradient. ``loss_agg_mode`` is ignored; the config refuses any other mode
    (``core_algos/loss_rules.py``: a sequence ratio summed over tokens length-weights the sequences).

    Args:
        old_log_prob: ``[b, t]``.
        log_prob: ``[b, t]``.
        advantages: ``[b, t]`` (may vary over a sequence).
        response_mask: ``[b, t]``.
        loss_agg_mode: Ignored (see above).
        config: ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``.
        rollout_is_weights: Optional per-token weights, ``[b, t]``.
        global_batch_info: The step's global denominators.

    Returns:
        ``(pg_loss, metrics)`` with ``actor/pg_clipfrac`` and ``actor/ppo_kl`` (token means).
    """
    del loss_agg_mode
    clip_low, clip_high = clip_range(config)
    log_ratio = log_prob - old_log_prob
    counts = response_mask.bool().sum(dim=-1).clamp_min(1).to(log_ratio.dtype)
    seq_log_ratio = masked_sum(log_ratio, response_mask, dim=-1) / counts
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg_losses = _weighted(torch.maximum(unclipped, clipped), rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, SEQ_MEAN_TOKEN_MEAN,
                       **agg_kwargs(config, global_batch_info))
    return pg_loss, {
        "actor/pg_clipfrac": Metric.token_mean((clipped > unclipped).float(), response_mask),
        "actor/ppo_kl": Metric.token_mean(-log_ratio, response_mask),
    }


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = TOKEN_MEAN,
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: Any = None,
) -> LossOutput:
    """CISPO (MiniMax-M1, arXiv:2506.13585, Eq. 4): REINFORCE weighted by the clipped, detached IS ratio.

    ``l_t = -sg[clip(r_t, 1 - eps_low, 1 + eps_high)] * A_t * log pi_t``: every token keeps a gradient (none
    is dropped by a clip as in PPO); only its weight is bounded. The paper tunes ``eps_high`` only and sets
    no lower bound: ``clip_ratio_low >= 1`` (a lower bound <= 0) does that. verl's and SkyRL's ``cispo``.

    Args:
        old_log_prob: ``[b, t]``.
        log_prob: ``[b, t]``.
        advantages: ``[b, t]``.
        response_mask: ``[b, t]``.
        loss_agg_mode: Any mode (the paper: ``token-mean``).
        config: ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high`` (the IS-weight bounds),
            ``loss_scale_factor``.
        rollout_is_weights: Optional per-token weights, ``[b, t]``.
        global_batch_info: The step's global denominators.

    Returns:
        ``(pg_loss, metrics)`` with ``actor/pg_clipfrac`` (tokens whose weight was clipped) and
        ``actor/ppo_kl``.
    """
    clip_low, clip_high = clip_range(config)
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high).detach()
    pg_losses = _weighted(-weight * advantages * log_prob, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs(config, global_batch_info))
    return pg_loss, {
        "actor/pg_clipfrac": Metric.token_mean((weight != ratio).float(), response_mask),
        "actor/ppo_kl": Metric.token_mean(-log_ratio, response_mask),
    }


@register_policy_loss("sapo")
def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = SEQ_MEAN_TOKEN_MEAN,
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: Any = None,
) -> LossOutput:
    """SAPO (Gao et al. 2025, arXiv:2511.20347, Eq. 5-6): a smooth sigmoid gate in place of the hard clip.

    ``f(r) = (4 / tau) * sigmoid(tau (r - 1))`` with ``tau = tau_pos`` where ``A_t > 0``, else ``tau_neg``;
    ``l_t = -f(r_t) A_t``. ``f'(1) = 1``, so on-policy the gradient is the policy gradient; off-policy
    tokens are damped smoothly (faster for negative advantages: ``tau_neg > tau_pos``). verl's and SkyRL's
    ``sapo``. Deviation: verl always aggregates ``seq-mean-token-mean`` (the paper's ``1/|y_i|``) and
    ignores ``loss_agg_mode``; the gate is per token, so here the mode is honoured (set
    ``seq-mean-token-mean`` for the paper's objective).

    Args:
        old_log_prob: ``[b, t]``.
        log_prob: ``[b, t]``.
        advantages: ``[b, t]``.
        response_mask: ``[b, t]``.
        loss_agg_mode: See :func:`agg_loss`.
        config: ``tau_pos`` (1.0), ``tau_neg`` (1.05), both > 0; ``loss_scale_factor``.
        rollout_is_weights: Optional per-token weights, ``[b, t]``.
        global_batch_info: The step's global denominators.

    Returns:
        ``(pg_loss, metrics)`` with ``actor/ppo_kl``.

    Raises:
        ValueError: ``tau_pos`` or ``tau_neg`` not > 0.
    """
    tau_pos = float(config_get(config, "tau_pos", 1.0))
    tau_neg = float(config_get(config, "tau_neg", 1.05))
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"sapo: tau_pos={tau_pos} and tau_neg={tau_neg} must both be > 0 (SAPO's defaults: "
                         "tau_pos=1.0, tau_neg=1.05)")
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    pg_losses = _weighted(-gate * advantages, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs(config, global_batch_info))
    return pg_loss, {"actor/ppo_kl": Metric.token_mean(-log_ratio, response_mask)}


def _dppo(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
          response_mask: torch.Tensor, valid: torch.Tensor, loss_agg_mode: str, config: Any,
          rollout_is_weights: torch.Tensor | None, global_batch_info: Any) -> LossOutput:
    """The DPPO surrogate given the trust-region mask ``valid`` ``[b, t]`` (bool)."""
    clip_ratio_c = float(config_get(config, "clip_ratio_c", 3.0))
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, max=clip_ratio_c).detach()
    kept = valid.detach().to(log_prob.dtype)
    pg_losses = _weighted(-advantages * weight * log_prob * kept, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs(config, global_batch_info))
    return pg_loss, {
        "actor/pg_clipfrac": Metric.token_mean(1.0 - kept, response_mask),
        "actor/pg_clipfrac_lower": Metric.token_mean((ratio > clip_ratio_c).to(kept.dtype) * kept,
                                                     response_mask),
        "actor/ppo_kl": Metric.token_mean(-log_ratio, response_mask),
    }


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = TOKEN_MEAN,
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: Any = None,
) -> LossOutput:
    """DPPO-Binary-TV ("Rethinking the Trust Region in LLM RL", arXiv:2602.04879): a probability-gap mask.

    A token leaves the trust region when its probability moved too far in the advantage's direction:
    ``A_t > 0`` and ``p_t - p_old_t > eps_high``, or ``A_t <= 0`` and ``p_t - p_old_t < -eps_low``
    (``p = exp(log_prob)``; ``clip_ratio_low`` / ``clip_ratio_high`` are total-variation thresholds here,
    not ratio ranges). Inside it ``l_t = -A_t * sg[min(r_t, clip_ratio_c)] * log pi_t``, outside 0. verl's
    ``dppo_tv`` (verl defaults ``clip_ratio_c`` to 20 for it; here the config's value is used).

    Args:
        old_log_prob: ``[b, t]``.
        log_prob: ``[b, t]``.
        advantages: ``[b, t]``.
        response_mask: ``[b, t]``.
        loss_agg_mode: See :func:`agg_loss`.
        config: ``clip_ratio`` / ``clip_ratio_low`` / ``clip_ratio_high`` (TV thresholds), ``clip_ratio_c``
            (the truncation of the IS weight), ``loss_scale_factor``.
        rollout_is_weights: Optional per-token weights, ``[b, t]``.
        global_batch_info: The step's global denominators.

    Returns:
        ``(pg_loss, metrics)``: ``actor/pg_clipfrac`` (tokens masked out), ``actor/pg_clipfrac_lower``
        (kept tokens whose weight was truncated), ``actor/ppo_kl``.
    """
    low, high = clip_range(config)
    gap = torch.exp(log_prob) - torch.exp(old_log_prob)
    valid = torch.where(advantages > 0, gap <= high, gap >= -low)
    return _dppo(old_log_prob, log_prob, advantages, response_mask, valid, loss_agg_mode, config,
                 rollout_is_weights, global_batch_info)


@register_policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = TOKEN_MEAN,
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: Any = None,
) -> LossOutput:
    """DPPO-Binary-KL (arXiv:2602.04879): the trust region by the KL of the token's binary distribution.

    ``d_t = p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p))`` (``1e-8`` added inside the
    second log). A token leaves the trust region when ``d_t`` exceeds ``eps_high`` (``A_t > 0``) or
    ``eps_low`` (``A_t <= 0``) **and** its probability moved in the advantage's direction; otherwise the
    surrogate of :func:`compute_policy_loss_dppo_tv`. verl's ``dppo_kl``.

    Args:
        old_log_prob: ``[b, t]``.
        log_prob: ``[b, t]``.
        advantages: ``[b, t]``.
        response_mask: ``[b, t]``.
        loss_agg_mode: See :func:`agg_loss`.
        config: ``clip_ratio`` / ``clip_ratio_low`` / ``clip_ratio_high`` (binary-KL thresholds),
            ``clip_ratio_c``, ``loss_scale_factor``.
        rollout_is_weights: Optional per-token weights, ``[b, t]``.
        global_batch_info: The step's global denominators.

    Returns:
        ``(pg_loss, metrics)`` as :func:`compute_policy_loss_dppo_tv`.
    """
    low, high = clip_range(config)
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    binary_kl = old_prob * (old_log_prob - log_prob) + (1.0 - old_prob) * torch.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
    valid = torch.where(advantages > 0, (binary_kl <= high) | (prob <= old_prob),
                        (binary_kl <= low) | (prob >= old_prob))
    return _dppo(old_log_prob, log_prob, advantages, response_mask, valid, loss_agg_mode, config,
                 rollout_is_weights, global_batch_info)
