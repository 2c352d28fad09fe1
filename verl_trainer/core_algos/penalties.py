"""KL estimators (:func:`kl_penalty`) and the clipped value loss (:func:`compute_value_loss`)."""

from __future__ import annotations

import torch

from verl_trainer.core_algos.aggregation import TOKEN_MEAN, Number, agg_loss, masked_mean

KL_PENALTY_TYPES: tuple[str, ...] = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
"""Base estimators; each may carry a trailing ``+`` (straight-through k2 gradient)."""


def _unknown(kind: object) -> ValueError:
    return ValueError(
        f"unknown kl_penalty {kind!r}; valid: {', '.join(KL_PENALTY_TYPES)}, each optionally with a "
        "trailing '+' (e.g. 'k3+'). ('full' needs the whole vocabulary distribution and is not supported.)"
    )


def _kl_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    diff = logprob - ref_logprob
    if kind in ("kl", "k1"):
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("mse", "k2"):
        return 0.5 * diff.square()
    if kind in ("low_var_kl", "k3"):
        # k3 = r - log r - 1 with r = p_ref / p (Schulman, "Approximating KL divergence", 2020);
        # the clamps are verl's, for numerical stability.
        log_r = torch.clamp(-diff, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(log_r) - log_r - 1.0, min=-10.0, max=10.0)
    raise _unknown(kind)


def validate_kl_penalty(kl_type: object) -> None:
    """Raise ``ValueError`` unless ``kl_type`` names a known estimator (with optional ``+``)."""
    base = kl_type[:-1] if isinstance(kl_type, str) and kl_type.endswith("+") else kl_type
    if base not in KL_PENALTY_TYPES:
        raise _unknown(kl_type)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the log-probs of the sampled tokens.

    Estimators: ``kl``/``k1`` = ``log p - log p_ref``; ``abs`` = its absolute value; ``mse``/``k2`` =
    ``0.5 (log p - log p_ref)^2``; ``low_var_kl``/``k3`` = ``r - log r - 1`` with ``r = p_ref / p``
    (clamped as verl does). A trailing ``+`` (e.g. ``"k3+"``) keeps the forward value of the named
    estimator but takes the gradient of ``k2``, whose expected gradient is the gradient of the KL
    (straight-through: ``k2 - k2.detach() + est.detach()``); ``"k2+"`` is ``k2``.

    Args:
        logprob: Log-probs under the current policy, ``[b, t]``.
        ref_logprob: Log-probs under the reference policy, ``[b, t]``.
        kl_penalty: Estimator name (see above).

    Returns:
        Per-token KL estimate, ``[b, t]``.

    Raises:
        ValueError: Unknown estimator name.

    """
    straight_through = kl_penalty.endswith("+")
    base = kl_penalty[:-1] if straight_through else kl_penalty
    forward = _kl_forward(logprob, ref_logprob, base)
    if not straight_through or base in ("mse", "k2"):
        return forward
    k2 = 0.5 * (logprob - ref_logprob).square()
    return k2 - k2.detach() + forward.detach()


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = TOKEN_MEAN,
    dp_size: int = 1,
    batch_num_tokens: Number | None = None,
    global_batch_size: Number | None = None,
    loss_scale_factor: Number | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value-function loss of PPO, aggregated with the step's global denominators.

    ``vf_loss = 0.5 * agg_loss(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2))``.
    verl 0.9.1's argument order; the trailing global-denominator arguments are this project's
    addition (verl aggregates the value loss with local denominators, which makes it depend on
    micro-batching and dp size).

    Args:
        vpreds: Predicted values of the current critic, ``[b, t]``.
        returns: Target returns, ``[b, t]``.
        values: Values at rollout time (the clipping centre), ``[b, t]``.
        response_mask: ``[b, t]``; 1 = the token counts.
        cliprange_value: Clip range ``c`` around ``values``.
        loss_agg_mode: See :func:`agg_loss`.
        dp_size: See :func:`agg_loss`.
        batch_num_tokens: See :func:`agg_loss`.
        global_batch_size: See :func:`agg_loss`.
        loss_scale_factor: See :func:`agg_loss`.

    Returns:
        ``(vf_loss, vf_clipfrac)``: the partial loss (scalar) and the local fraction of tokens where
        the clipped term was larger (scalar; a token mean over this micro-batch).

    """
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    losses_unclipped = (vpreds - returns).square()
    losses_clipped = (vpred_clipped - returns).square()
    vf_loss = 0.5 * agg_loss(
        torch.maximum(losses_unclipped, losses_clipped),
        response_mask,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    vf_clipfrac = masked_mean(torch.gt(losses_clipped, losses_unclipped).float(), response_mask)
    return vf_loss, vf_clipfrac
