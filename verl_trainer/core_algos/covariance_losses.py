"""Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv:2505.22617).

Both act on the few tokens whose centred covariance ``cov_t = (A_t - mean A) (log pi_t - mean log pi)`` is
high — the tokens that drive entropy collapse:

* **clip_cov**: among the tokens with ``clip_cov_lb < cov_t < clip_cov_ub``, ``clip_cov_ratio x N`` chosen at
  random (``N``: the step's tokens; at least one) lose their gradient: the PPO clipped loss
  ``max(-A r, -A clip(r))`` is multiplied by 0 there.
* **kl_cov**: the ``kl_cov_ratio x N`` tokens of largest ``cov_t`` (at least one) get a KL penalty:
  ``l_t = -A_t r_t + ppo_kl_coef * |log r_t|``; the others ``-A_t r_t``.

verl selects per micro-batch, from the current log-probs, with ``torch.randperm`` (clip-cov): the choice
changes with micro-batching, the dp size and the seed. Here the selection is made once per optimizer step
over the **whole step** — every DP rank's mini-batch — by :func:`prepare_clip_cov` / :func:`prepare_kl_cov`,
which :meth:`~verl_trainer.core_algos.losses.PPOLoss.prepare` calls before the engine splits the batch
(``policy_losses.set_batch_preparer``), so it does not depend on the layout:

* the covariance uses the step's ``old_log_probs`` (at the step's first update these are the current
  log-probs; verl uses the current ones of each micro-batch);
* the means and the thresholds come from every valid token of the step, all-gathered and sorted into one
  canonical order before summing, so every layout computes them bit for bit alike;
* clip-cov's "random" choice is a hash of each token's identity (``uid``, position, token id, old log-prob
  bits): a fixed pseudo-random priority, the same whatever rank or micro-batch holds the token; the
  ``clip_num`` tokens of lowest priority are chosen;
* equal covariances (e.g. every advantage equal) are ordered by the same priority in KL-Cov; only tokens
  equal in both (identical tokens) tie, and a tie at the threshold selects every tied token;
* verl also excludes tokens PPO already clips from clip-cov's candidates; those have no gradient either
  way, so only the loss value and the count differ.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from verl_trainer.core_algos.aggregation import TOKEN_MEAN, agg_loss, loss_mask_of
from verl_trainer.core_algos.policy_losses import (
    agg_kwargs,
    clip_range,
    config_get,
    register_policy_loss,
    set_batch_preparer,
)
from verl_trainer.data import schema
from verl_trainer.metrics import Metric
from verl_trainer.utils.distributed import all_gather_object

LossOutput = tuple[torch.Tensor, dict[str, Metric]]
_PRIORITY_BITS = 52  # priorities are exact in float64
_MIX = (0x1F3D5B79A2C4E687, 0x2545F4914F6CDD1D, 0x5851F42D4C957F2D, 0x7FB5D329728EA185)


def token_priority(log_probs: torch.Tensor, input_ids: torch.Tensor | None = None,
                   uid: torch.Tensor | None = None) -> torch.Tensor:
    """A fixed pseudo-random priority per token, ``[B, T]`` int64 in ``[0, 2**52)``.

    A hash of (``uid``, column, token id, the float32 bits of the log-prob): the same for the same token
    whatever batch, rank or micro-batch holds it (rows are left-aligned, so the column is the position).

    Args:
        log_probs: ``[B, T]`` (the step's old log-probs).
        input_ids: ``[B, T]``; ``None``: 0.
        uid: ``[B]`` group ids; ``None``: 0.
    """
    rows, width = log_probs.shape
    device = log_probs.device
    bits = log_probs.detach().to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
    pos = torch.arange(width, device=device, dtype=torch.int64).expand(rows, width)
    tok = torch.zeros_like(bits) if input_ids is None else input_ids.to(torch.int64)
    group = torch.zeros(rows, 1, dtype=torch.int64, device=device) if uid is None \
        else uid.to(torch.int64).reshape(rows, 1)
    h = group * _MIX[0] ^ pos * _MIX[1] ^ tok * _MIX[2] ^ bits * _MIX[3]
    for mult in (_MIX[3], _MIX[1]):  # xor-shift-multiply rounds (int64 wraps)
        h = (h ^ (h >> 31)) * mult
    h = h ^ (h >> 29)
    return h & ((1 << _PRIORITY_BITS) - 1)


def _canonical_pool(columns: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's ``[n_r, C]`` float64 rows, concatenated and sorted lexicographically (a collective)."""
    pool = torch.cat([t for t in all_gather_object(columns.cpu(), group)])  # type: ignore[misc]
    for c in reversed(range(pool.shape[1])):  # stable sorts, last key first: a lexicographic order
        pool = pool[torch.sort(pool[:, c], stable=True).indices]
    return pool


def _selection_stats(adv: torch.Tensor, log_prob: torch.Tensor, mask: torch.Tensor, priority: torch.Tensor,
                     group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(local cov [B, T] float64, pool cov [N], pool priority [N])`` over the step's valid tokens."""
    valid = mask.bool()
    a, lp = adv.detach().to(torch.float64), log_prob.detach().to(torch.float64)
    local = torch.stack([a[valid], lp[valid], priority[valid].to(torch.float64)], dim=-1).cpu()
    pool = _canonical_pool(local, group)
    count = max(pool.shape[0], 1)
    mean_a, mean_lp = pool[:, 0].sum() / count, pool[:, 1].sum() / count
    cov = ((a - mean_a.to(a.device)) * (lp - mean_lp.to(a.device))).masked_fill(~valid, float("-inf"))
    return cov, (pool[:, 0] - mean_a) * (pool[:, 1] - mean_lp), pool[:, 2]


def _ratio(config: Any, name: str, default: float) -> float:
    value = float(config_get(config, name, default))
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name}={value} must be in (0, 1] (the fraction of the step's tokens selected; "
                         f"the paper's default {default})")
    return value


def select_kl_cov(adv: torch.Tensor, log_prob: torch.Tensor, mask: torch.Tensor, priority: torch.Tensor,
                  config: Any = None, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """KL-Cov's tokens: the ``max(1, int(kl_cov_ratio x N))`` of largest covariance over the step, ``[B, T]``.

    Equal covariances (all advantages equal, for one) are ordered by ``priority`` (lowest first), so
    exactly that many are chosen unless tokens tie in both. Collective over ``group`` (every rank calls it
    with its share of the step; ``None``: this batch alone).
    """
    ratio = _ratio(config, "kl_cov_ratio", 2e-4)
    cov, pool_cov, pool_priority = _selection_stats(adv, log_prob, mask, priority, group)
    if pool_cov.numel() == 0:
        return torch.zeros_like(log_prob, dtype=torch.float32)
    k = max(1, int(pool_cov.numel() * ratio))
    order = torch.sort(pool_priority, stable=True).indices  # priority ascending, then covariance descending
    order = order[torch.sort(pool_cov[order], descending=True, stable=True).indices]
    last_cov, last_priority = pool_cov[order[k - 1]], pool_priority[order[k - 1]]
    prio = priority.to(torch.float64)
    chosen = (cov > last_cov) | ((cov == last_cov) & (prio <= last_priority))
    return (chosen & mask.bool()).to(torch.float32)


def select_clip_cov(adv: torch.Tensor, log_prob: torch.Tensor, mask: torch.Tensor, priority: torch.Tensor,
                    config: Any = None, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Clip-Cov's tokens, ``[B, T]``: the ``clip_num`` of lowest ``priority`` in the covariance band.

    Of the step's tokens with ``clip_cov_lb < cov < clip_cov_ub``, the ``max(1, int(clip_cov_ratio x N))``
    of lowest ``priority`` (all of them when fewer). Collective over ``group``.
    """
    ratio = _ratio(config, "clip_cov_ratio", 2e-4)
    low, high = float(config_get(config, "clip_cov_lb", 1.0)), float(config_get(config, "clip_cov_ub", 5.0))
    if not low < high:
        raise ValueError(f"clip_cov_lb={low} must be < clip_cov_ub={high} (the paper: 1.0 and 5.0)")
    cov, pool_cov, pool_priority = _selection_stats(adv, log_prob, mask, priority, group)
    band = (cov > low) & (cov < high) & mask.bool()
    pool_band = (pool_cov > low) & (pool_cov < high)
    clip_num = max(1, int(pool_cov.numel() * ratio))
    if int(pool_band.sum()) <= clip_num:
        return band.to(torch.float32)
    threshold = torch.kthvalue(pool_priority[pool_band], clip_num).values
    return (band & (priority.to(torch.float64) <= threshold.to(cov.device))).to(torch.float32)


def _batch_inputs(batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    for key in (schema.ADVANTAGES, schema.OLD_LOG_PROBS):
        if key not in batch.keys():
            raise KeyError(f"clip_cov / kl_cov selection needs {key!r} ([B, T]) in the batch before the "
                           "update")
    return batch[schema.ADVANTAGES], batch[schema.OLD_LOG_PROBS], loss_mask_of(batch)


def _batch_priority(batch: Any, old_log_probs: torch.Tensor) -> torch.Tensor:
    uid = batch[schema.UID] if schema.UID in batch.keys() else None
    ids = batch[schema.INPUT_IDS] if schema.INPUT_IDS in batch.keys() else None
    return token_priority(old_log_probs, ids, uid)


def prepare_kl_cov(batch: Any, config: Any, group: dist.ProcessGroup | None) -> torch.Tensor:
    """KL-Cov's selection for this rank's share of the step (a collective).

    :func:`select_kl_cov` on ``old_log_probs``, ties ordered by :func:`token_priority`.
    """
    adv, old, mask = _batch_inputs(batch)
    return select_kl_cov(adv, old, mask, _batch_priority(batch, old), config, group)


def prepare_clip_cov(batch: Any, config: Any, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Clip-Cov's selection for this rank's share of the step (a collective).

    :func:`select_clip_cov` on ``old_log_probs``, with :func:`token_priority` of ``uid`` and ``input_ids``.
    """
    adv, old, mask = _batch_inputs(batch)
    return select_clip_cov(adv, old, mask, _batch_priority(batch, old), config, group)



@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = TOKEN_MEAN,
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: Any = None,
    prepared: torch.Tensor | None = None,
) -> LossOutput:
    """Clip-Cov (arXiv:2505.22617, Sec. 4): PPO's clipped loss with the selected tokens' gradient cut.

    ``l_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high)) * (1 - s_t)``, ``s_t`` = 1 on the tokens
    :func:`select_clip_cov` chose over the whole step (``prepared``, see the module docstring). Called
    without ``prepared`` (verl's call) it selects from this call's tokens and current log-probs, which is
    exact only when the call sees the whole step.

    Args:
        old_log_prob: ``[b, t]``.
        log_prob: ``[b, t]``.
        advantages: ``[b, t]``.
        response_mask: ``[b, t]``.
        loss_agg_mode: See :func:`agg_loss`.
        config: ``clip_ratio`` / ``_low`` / ``_high``, ``clip_cov_ratio`` (2e-4), ``clip_cov_lb`` (1.0),
            ``clip_cov_ub`` (5.0), ``loss_scale_factor``.
        rollout_is_weights: Optional per-token weights, ``[b, t]``.
        global_batch_info: The step's global denominators.
        prepared: The step's selection for these rows, ``[b, t]`` (1 = selected).

    Returns:
        ``(pg_loss, metrics)``: ``actor/pg_clipfrac`` (selected tokens) and ``actor/ppo_kl``.
    """
    if prepared is None:
        priority = token_priority(log_prob)
        prepared = select_clip_cov(advantages, log_prob, response_mask, priority, config)
    clip_low, clip_high = clip_range(config)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    losses = torch.maximum(-advantages * ratio, -advantages * clipped_ratio)
    selected = prepared.to(losses.dtype)
    pg_losses = losses * (1.0 - selected)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs(config, global_batch_info))
    return pg_loss, {
        "actor/pg_clipfrac": Metric.token_mean(selected, response_mask),
        "actor/ppo_kl": Metric.token_mean(-log_ratio, response_mask),
    }


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = TOKEN_MEAN,
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: Any = None,
    prepared: torch.Tensor | None = None,
) -> LossOutput:
    """KL-Cov (arXiv:2505.22617, Sec. 4): the policy gradient plus a KL penalty on the selected tokens.

    ``l_t = -A_t r_t + s_t * ppo_kl_coef * |log r_t|`` (no clipping), ``s_t`` = 1 on the tokens
    :func:`select_kl_cov` chose over the whole step (``prepared``). Without ``prepared`` (verl's call) it
    selects from this call's tokens and current log-probs.

    Args:
        old_log_prob: ``[b, t]``.
        log_prob: ``[b, t]``.
        advantages: ``[b, t]``.
        response_mask: ``[b, t]``.
        loss_agg_mode: See :func:`agg_loss`.
        config: ``kl_cov_ratio`` (2e-4), ``ppo_kl_coef`` (1.0), ``loss_scale_factor``.
        rollout_is_weights: Optional per-token weights, ``[b, t]``.
        global_batch_info: The step's global denominators.
        prepared: The step's selection for these rows, ``[b, t]`` (1 = selected).

    Returns:
        ``(pg_loss, metrics)``: ``actor/pg_clipfrac`` (selected tokens) and ``actor/ppo_kl``.
    """
    if prepared is None:
        prepared = select_kl_cov(advantages, log_prob, response_mask, token_priority(log_prob), config)
    coef = float(config_get(config, "ppo_kl_coef", 1.0))
    log_ratio = log_prob - old_log_prob
    selected = prepared.to(log_ratio.dtype)
    pg_losses = -advantages * torch.exp(log_ratio) + selected * coef * log_ratio.abs()
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs(config, global_batch_info))
    return pg_loss, {
        "actor/pg_clipfrac": Metric.token_mean(selected, response_mask),
        "actor/ppo_kl": Metric.token_mean(-log_ratio, response_mask),
    }


set_batch_preparer(compute_policy_loss_clip_cov, prepare_clip_cov)
set_batch_preparer(compute_policy_loss_kl_cov, prepare_kl_cov)
