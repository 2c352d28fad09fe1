"""The policy-loss registry and the built-in policy losses (vanilla/dual-clip PPO, GSPO, GPG, GMPO).

More losses register from ``ratio_losses`` (GSPO-token, CISPO, SAPO, DPPO) and ``covariance_losses``
(clip-cov, KL-cov); which aggregation modes each accepts is ``loss_rules``.

A policy loss has verl 0.9.1's signature plus one keyword::

    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
       rollout_is_weights=None, global_batch_info=None) -> (pg_loss, metrics)

All tensors are ``[b, t]``. ``config`` is read by attribute or key (``clip_ratio``, ``clip_ratio_low``,
``clip_ratio_high``, ``clip_ratio_c``, ``loss_scale_factor``), e.g. a
:class:`verl_trainer.core_algos.losses.PPOLossConfig`. ``global_batch_info`` is the engine's
:class:`~verl_trainer.core_algos.aggregation.GlobalBatchInfo` (or verl's dict of the same keys); verl instead
mutates ``config.global_batch_info`` on every micro-batch, which a frozen typed config cannot do.

Every loss aggregates through :func:`agg_loss` with the global denominators, so ``pg_loss`` is a partial
value (none takes a local mean). ``metrics`` maps verl's names (e.g. ``actor/pg_clipfrac``; all of them:
docs/metrics.md) to :class:`~verl_trainer.metrics.Metric` token means weighted by the token count, so they
reduce to the token mean of the whole step (verl returns local means as floats).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from verl_trainer.core_algos.aggregation import (
    SEQ_MEAN_TOKEN_MEAN,
    TOKEN_MEAN,
    agg_loss,
    global_batch_kwargs,
    masked_sum,
)
from verl_trainer.metrics import Metric
from verl_trainer.utils.registry import Registry

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, Metric]]]

POLICY_LOSS_REGISTRY: Registry[PolicyLossFn] = Registry("policy loss")


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register a policy loss under ``name`` (decorator; a duplicate name raises ``ValueError``)."""
    return POLICY_LOSS_REGISTRY.register(name)


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """Return the policy loss registered as ``name``, or the function ``"module:name"`` / ``"file.py:name"``.

    Raises:
        ValueError: An unknown name (listing all), a module, file or attribute that does not exist, or an
            object that is not callable.
    """
    fn = POLICY_LOSS_REGISTRY.resolve(name)
    if not callable(fn):
        raise ValueError(f"policy loss {name!r} is a {type(fn).__name__}, not a callable")
    return fn


BatchPreparer = Callable[[Any, Any, Any], torch.Tensor]
"""``prepare(batch, config, dp_group) -> [B, T]``: what a policy loss needs computed over the whole step."""

_PREPARERS: dict[Callable, BatchPreparer] = {}


def set_batch_preparer(loss_fn: PolicyLossFn, preparer: BatchPreparer) -> None:
    """Declare that ``loss_fn`` reads a per-token tensor computed over the whole optimizer step.

    Some losses select tokens by a statistic of the whole batch (clip-cov / KL-cov: a covariance over
    every token of the step). Computed per micro-batch, such a choice changes with micro-batching and
    the dp size; so :meth:`~verl_trainer.core_algos.losses.PPOLoss.prepare` calls ``preparer`` on each
    rank's whole mini-batch (a collective over the DP group) before the engine splits it, stores the
    result under :data:`PREPARED_KEY`, and the loss receives it as ``prepared=`` per micro-batch.
    """
    _PREPARERS[loss_fn] = preparer


def batch_preparer(loss_fn: PolicyLossFn) -> BatchPreparer | None:
    """The preparer declared for ``loss_fn`` (:func:`set_batch_preparer`), or ``None``."""
    return _PREPARERS.get(loss_fn)


PREPARED_KEY = "policy_loss_prepared"
"""The batch key (``[B, T]`` float) holding a prepared policy loss's per-token tensor."""


def config_get(config: Any, name: str, default: Any = None) -> Any:
    """Read ``name`` from a config object (attribute) or mapping (key)."""
    if config is None:
        return default
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def clip_range(config: Any) -> tuple[float, float]:
    """``(clip_ratio_low, clip_ratio_high)``, each defaulting to ``clip_ratio`` (DAPO's clip-higher)."""
    clip_ratio = config_get(config, "clip_ratio", 0.2)
    low = config_get(config, "clip_ratio_low", None)
    high = config_get(config, "clip_ratio_high", None)
    return (clip_ratio if low is None else low), (clip_ratio if high is None else high)


def agg_kwargs(config: Any, global_batch_info: Any) -> dict[str, Any]:
    """``agg_loss``'s global-denominator keywords from a loss's ``global_batch_info`` and config."""
    return global_batch_kwargs(global_batch_info, config_get(config, "loss_scale_factor", None))


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = TOKEN_MEAN,
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: Any = None,
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Clipped PPO surrogate with dual clip (Ye et al. 2020) and asymmetric clip range (DAPO).

    Per token, with ``r = exp(log_prob - old_log_prob)`` (log-ratio clamped to [-20, 20]):
    ``l = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))``, and for ``A < 0`` also
    ``l = min(l, -A clip_ratio_c)``. Optionally times ``rollout_is_weights``; then :func:`agg_loss`.

    Args:
        old_log_prob: Log-probs at rollout time, ``[b, t]``.
        log_prob: Log-probs of the current policy, ``[b, t]`` (differentiable).
        advantages: ``[b, t]``.
        response_mask: ``[b, t]``; 1 = the token is trained.
        loss_agg_mode: See :func:`agg_loss`.
        config: ``clip_ratio`` (0.2), ``clip_ratio_low``/``clip_ratio_high`` (default ``clip_ratio``),
            ``clip_ratio_c`` (3.0, must be > 1), ``loss_scale_factor``.
        rollout_is_weights: Optional per-token importance weights (rollout vs training engine), ``[b, t]``.
        global_batch_info: The step's global denominators (see the module docstring).

    Returns:
        ``(pg_loss, metrics)``: the partial loss and ``actor/pg_clipfrac``, ``actor/ppo_kl``,
        ``actor/pg_clipfrac_lower`` (token means).

    """
    clip_low, clip_high = clip_range(config)
    clip_ratio_c = config_get(config, "clip_ratio_c", 3.0)
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (the dual-clip bound) must be > 1.0, got {clip_ratio_c}")
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    losses_unclipped = -advantages * ratio
    losses_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clip_losses = torch.maximum(losses_unclipped, losses_clipped)
    losses_dual = -advantages * clip_ratio_c
    negative_adv = advantages < 0
    pg_losses = torch.where(negative_adv, torch.minimum(losses_dual, clip_losses), clip_losses)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs(config, global_batch_info))
    metrics = {
        "actor/pg_clipfrac": Metric.token_mean((losses_clipped > losses_unclipped).float(), response_mask),
        "actor/ppo_kl": Metric.token_mean(-log_ratio, response_mask),
        "actor/pg_clipfrac_lower": Metric.token_mean(
            (torch.gt(clip_losses, losses_dual) & negative_adv).float(), response_mask
        ),
    }
    return pg_loss, metrics


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = SEQ_MEAN_TOKEN_MEAN,
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: Any = None,
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """GSPO, the sequence variant (Zheng et al. 2025, arXiv:2507.18071, Eq. 5): a clipped sequence ratio.

    ``s_i = exp(mean_t log(pi/pi_old))`` over the tokens of sequence ``i`` (log clamped at 10),
    ``A_i = mean_t A_{i,t}`` and ``J = (1/G) sum_i min(s_i A_i, clip(s_i, 1 - clip_ratio_low,
    1 + clip_ratio_high) A_i)``; the gradient of ``s_i`` is ``s_i mean_t grad log pi_t``. The sequence loss
    is aggregated ``seq-mean-token-mean`` (each sequence counts once): the only mode in which this is GSPO's
    objective, so :class:`~verl_trainer.core_algos.losses.PPOLossConfig` refuses every other mode
    (``core_algos/loss_rules.py``); here ``loss_agg_mode`` is accepted and ignored, as verl does.

    With advantages constant over each sequence (every outcome estimator) this equals verl's ``gspo`` in
    value and gradient. verl's function computes the token form for any advantages, i.e. GSPO-token when
    they vary over a sequence; that is ``gspo_token`` here.

    Args:
        old_log_prob: ``[b, t]``.
        log_prob: ``[b, t]``.
        advantages: ``[b, t]``; their token mean per sequence is the sequence's advantage.
        response_mask: ``[b, t]``.
        loss_agg_mode: Ignored (see above).
        config: ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high`` (GSPO uses small values, e.g. 3e-4 and
            4e-4).
        rollout_is_weights: Optional per-token weights, ``[b, t]`` (they multiply each token's share).
        global_batch_info: The step's global denominators.

    Returns:
        ``(pg_loss, metrics)`` with ``actor/pg_clipfrac`` (tokens of clipped sequences) and ``actor/ppo_kl``
        (token means).

    """
    del loss_agg_mode
    clip_low, clip_high = clip_range(config)
    log_ratio = log_prob - old_log_prob
    counts = response_mask.bool().sum(dim=-1).clamp_min(1).to(log_ratio.dtype)
    seq_log_ratio = masked_sum(log_ratio, response_mask, dim=-1) / counts  # [b], differentiable
    seq_ratio = torch.exp(torch.clamp(seq_log_ratio, max=10.0))
    seq_adv = masked_sum(advantages, response_mask, dim=-1) / counts
    seq_unclipped = -seq_adv * seq_ratio
    seq_clipped = -seq_adv * torch.clamp(seq_ratio, 1.0 - clip_low, 1.0 + clip_high)
    seq_losses = torch.maximum(seq_unclipped, seq_clipped)  # [b]
    pg_losses = seq_losses.unsqueeze(-1).expand_as(log_ratio)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, SEQ_MEAN_TOKEN_MEAN,
                       **agg_kwargs(config, global_batch_info))
    clipped = (seq_clipped > seq_unclipped).float().unsqueeze(-1).expand_as(log_ratio)
    metrics = {
        "actor/pg_clipfrac": Metric.token_mean(clipped, response_mask),
        "actor/ppo_kl": Metric.token_mean(-log_ratio, response_mask),
    }
    return pg_loss, metrics


@register_policy_loss("gpg")
def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = TOKEN_MEAN,
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: Any = None,
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """GPG (Chu et al. 2025): the plain policy gradient ``-A log_prob``, no ratio and no clipping.

    Args:
        old_log_prob: Unused (kept for the common signature), ``[b, t]``.
        log_prob: ``[b, t]``.
        advantages: ``[b, t]``.
        response_mask: ``[b, t]``.
        loss_agg_mode: See :func:`agg_loss`.
        config: ``loss_scale_factor`` only.
        rollout_is_weights: Optional per-token weights, ``[b, t]`` (verl ignores them; applied here).
        global_batch_info: The step's global denominators.

    Returns:
        ``(pg_loss, {})``.

    """
    del old_log_prob
    pg_losses = -log_prob * advantages
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs(config, global_batch_info))
    return pg_loss, {}


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = SEQ_MEAN_TOKEN_MEAN,
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: Any = None,
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """GMPO (Zhao et al. 2025, arXiv:2507.20673): the geometric mean of token ratios, clipped per token.

    Per token the log-ratio is clipped to ``[-clip_ratio_low, clip_ratio_high]`` on the pessimistic side
    (by the sign of the advantage); ``ratio_i = exp(mean_t clipped log-ratio)``, ``A_i = mean_t A``, and the
    sequence loss is ``-A_i ratio_i``. verl averages the sequence losses over the local batch
    (``torch.mean``, which depends on micro-batching); here the sequence loss is aggregated
    ``seq-mean-token-mean`` with the global sample count, which for one whole batch without empty rows
    equals verl's value. ``loss_agg_mode`` is ignored (as in verl); the config refuses every mode but
    ``seq-mean-token-mean`` (``core_algos/loss_rules.py``). Also registered as ``gmpo``.

    Args:
        old_log_prob: ``[b, t]``.
        log_prob: ``[b, t]``.
        advantages: ``[b, t]`` (sequence-level advantages).
        response_mask: ``[b, t]``.
        loss_agg_mode: Ignored.
        config: ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high`` (GMPO uses wide ranges, e.g. 0.4).
        rollout_is_weights: Unsupported (a sequence-level ratio has no per-token weight); must be None.
        global_batch_info: The step's global denominators.

    Returns:
        ``(pg_loss, metrics)`` with ``actor/pg_clipfrac`` (clipped tokens with ``A > 0``),
        ``actor/pg_clipfrac_lower`` (``A < 0``) and ``actor/ppo_kl``.

    """
    del loss_agg_mode
    if rollout_is_weights is not None:
        raise ValueError(
            "policy_loss='geo_mean' does not support rollout_is_weights; use 'vanilla' or 'gspo'."
        )
    clip_low, clip_high = clip_range(config)
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    log_ratio_clipped = torch.clamp(log_ratio, -clip_low, clip_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * log_ratio_clipped)
    counts = response_mask.bool().sum(dim=-1).to(log_ratio.dtype)  # [b]
    seq_ratio = torch.exp(masked_sum(pessimistic, response_mask, dim=-1) / (counts + 1e-8))
    seq_adv = masked_sum(advantages, response_mask, dim=-1) / (counts + 1e-8)
    seq_losses = (-seq_adv * seq_ratio).unsqueeze(-1).expand_as(log_ratio)
    pg_loss = agg_loss(seq_losses, response_mask, SEQ_MEAN_TOKEN_MEAN,
                       **agg_kwargs(config, global_batch_info))
    clipped = torch.ne(log_ratio, log_ratio_clipped)
    metrics = {
        "actor/pg_clipfrac": Metric.token_mean((clipped & (advantages > 0)).float(), response_mask),
        "actor/pg_clipfrac_lower": Metric.token_mean((clipped & (advantages < 0)).float(), response_mask),
        "actor/ppo_kl": Metric.token_mean(-log_ratio, response_mask),
    }
    return pg_loss, metrics


POLICY_LOSS_REGISTRY.add("gmpo", compute_policy_loss_geo_mean)  # the paper's name for verl's geo_mean
