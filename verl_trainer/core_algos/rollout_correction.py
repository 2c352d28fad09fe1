"""Train/inference mismatch: metrics, and truncated / masked importance sampling (TIS / MIS).

With ``q`` the probability the rollout sampled a token with (``rollout_log_probs``) and ``pi_old`` the
trainer's (``old_log_probs``), the weight of the ratio ``rho = pi_old / q`` per token (``level="token"``)
or per sequence (``level="sequence"``: ``prod_t rho_t``), with a threshold ``C``, is:

* ``mode="truncate"`` (TIS): ``w = min(rho, C)``;
* ``mode="mask"`` (MIS): ``w = rho`` inside ``[threshold_lower, C]``, else ``0``; a masked token (or
  sequence) trains nothing but stays in the loss denominators.

Invariants: ``w`` is detached and multiplies the per-token policy loss (``rollout_is_weights`` of every
policy loss); log-ratios are clamped to ``[-20, 20]`` before ``exp``; every metric declares its reduction,
so the logged values are the whole step's at any dp size and micro-batching (names: docs/metrics.md; how
they compare with verl's and TRL's: docs/internals.md, *Train/inference mismatch*).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_trainer.core_algos.aggregation import masked_sum
from verl_trainer.metrics import Metric

__all__ = [
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_IS_MODES",
    "SAFETY_BOUND",
    "RolloutCorrectionConfig",
    "compute_rollout_is_weights",
    "rollout_mismatch_metrics",
]

ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_IS_MODES = ("truncate", "mask")
_TRL_MODES = {f"{level}_{mode}": (level, mode) for level in ROLLOUT_IS_LEVELS for mode in ROLLOUT_IS_MODES}
"""TRL's ``vllm_importance_sampling_mode`` values, accepted as ``level`` (they also set ``mode``)."""
SAFETY_BOUND = 20.0
"""Log-ratios are clamped to ``[-SAFETY_BOUND, SAFETY_BOUND]`` before ``exp`` (as verl)."""


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Importance sampling of the rollout -> trainer ratio in the policy loss (off by default).

    The YAML section is ``algorithm.rollout_correction``; verl's and TRL's keys are aliases
    (``docs/verl_keys.md``).

    Attributes:
        level: ``None`` (off), ``"token"`` (one ratio per token) or ``"sequence"`` (the product over the
            response). TRL's combined values (``token_truncate``, ``token_mask``, ``sequence_truncate``,
            ``sequence_mask``) are accepted and also set ``mode``.
        mode: ``"truncate"`` (TIS: ``min(rho, threshold)``) or ``"mask"`` (MIS: ``rho`` inside
            ``[threshold_lower, threshold]``, else 0).
        threshold: The upper bound ``C`` (> 0; verl's default 2.0).
        threshold_lower: ``mask`` only: the lower bound (``None``: no lower bound, as TRL; verl 0.6 used
            ``1 / threshold``).

    """

    level: str | None = None
    mode: str = "truncate"
    threshold: float = 2.0
    threshold_lower: float | None = None

    def __post_init__(self) -> None:
        if self.level in _TRL_MODES:
            level, mode = _TRL_MODES[self.level]
            object.__setattr__(self, "level", level)
            object.__setattr__(self, "mode", mode)
        if self.level is not None and self.level not in ROLLOUT_IS_LEVELS:
            raise ValueError(
                f"rollout_correction.level={self.level!r} is unknown; choose null (off), one of "
                f"{ROLLOUT_IS_LEVELS}, or one of TRL's {tuple(_TRL_MODES)}"
            )
        if self.mode not in ROLLOUT_IS_MODES:
            raise ValueError(f"rollout_correction.mode={self.mode!r} is unknown; choose one of "
                             f"{ROLLOUT_IS_MODES} (truncate = TIS, mask = MIS)")
        if not self.threshold > 0:
            raise ValueError(f"rollout_correction.threshold={self.threshold!r} must be > 0 "
                             "(verl's default 2.0)")
        if self.threshold_lower is not None:
            if self.mode != "mask":
                raise ValueError(
                    f"rollout_correction.threshold_lower={self.threshold_lower} only applies to mode='mask'; "
                    "remove it or set rollout_correction.mode=mask"
                )
            if not 0 <= self.threshold_lower < self.threshold:
                raise ValueError(
                    f"rollout_correction.threshold_lower={self.threshold_lower} must be in "
                    f"[0, threshold={self.threshold})"
                )

    @property
    def enabled(self) -> bool:
        """Whether the policy loss is weighted (``level`` is set)."""
        return self.level is not None


def _row_counts(mask: torch.Tensor) -> torch.Tensor:
    """``[b]`` tokens per row (float)."""
    return mask.sum(dim=-1).to(torch.float32)


def _seq_mean(values: torch.Tensor, rows: torch.Tensor) -> Metric:
    """The mean of ``values [b]`` over the rows with tokens, weighted by their count (a sequence mean)."""
    n = rows.sum()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    total = torch.where(rows, values.detach(), zero).sum()
    return Metric.mean(total / n.clamp_min(1).to(total.dtype), weight=n)


def rollout_mismatch_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                             response_mask: torch.Tensor) -> dict[str, Metric]:
    """Mismatch between the trainer's and the rollout's log-probs of the sampled tokens.

    Args:
        old_log_prob: ``[b, t]`` the trainer's log-probs (``pi_old``).
        rollout_log_prob: ``[b, t]`` the sampler's log-probs (``q``).
        response_mask: ``[b, t]`` 1 on the response tokens.

    Returns:
        ``rollout_corr/{kl, k3_kl, chi2_token, log_prob_abs_diff_mean}`` and
        ``training/rollout_probs_diff_mean`` (token means); ``rollout_corr/{training_ppl, rollout_ppl,
        ppl_ratio, log_ppl_diff, log_ppl_abs_diff, chi2_seq}`` (sequence means: a sequence's PPL is
        ``exp(-mean_t log p)``); ``rollout_corr/log_prob_abs_diff_max``, ``training/rollout_probs_diff_max``,
        ``rollout_corr/log_ppl_diff_max`` (MAX) and ``rollout_corr/log_ppl_diff_min`` (MIN).
    """
    mask = response_mask.bool()
    old = old_log_prob.detach().float()
    rollout = rollout_log_prob.detach().float()
    zero = torch.zeros((), device=old.device)
    log_ratio = torch.where(mask, old - rollout, zero).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # log(pi_old / q)
    abs_diff = log_ratio.abs()
    probs_diff = (old.exp() - rollout.exp()).abs()
    counts = _row_counts(mask)
    rows = counts > 0
    mean_old = masked_sum(old, mask, dim=-1) / counts.clamp_min(1)
    mean_rollout = masked_sum(rollout, mask, dim=-1) / counts.clamp_min(1)
    log_ppl_diff = mean_rollout - mean_old  # log(training_ppl / rollout_ppl)
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "rollout_corr/kl": Metric.token_mean(-log_ratio, mask),
        "rollout_corr/k3_kl": Metric.token_mean(log_ratio.exp() - log_ratio - 1, mask),
        "rollout_corr/chi2_token": Metric.token_mean(torch.exp(2 * log_ratio) - 1, mask),
        "rollout_corr/chi2_seq": _seq_mean(torch.exp(2 * seq_log_ratio) - 1, rows),
        "rollout_corr/training_ppl": _seq_mean(torch.exp(-mean_old), rows),
        "rollout_corr/rollout_ppl": _seq_mean(torch.exp(-mean_rollout), rows),
        "rollout_corr/ppl_ratio": _seq_mean(torch.exp(log_ppl_diff), rows),
        "rollout_corr/log_ppl_diff": _seq_mean(log_ppl_diff, rows),
        "rollout_corr/log_ppl_abs_diff": _seq_mean(log_ppl_diff.abs(), rows),
        "rollout_corr/log_ppl_diff_max": Metric.max(log_ppl_diff[rows]),
        "rollout_corr/log_ppl_diff_min": Metric.min(log_ppl_diff[rows]),
        "rollout_corr/log_prob_abs_diff_mean": Metric.token_mean(abs_diff, mask),
        "rollout_corr/log_prob_abs_diff_max": Metric.max(abs_diff[mask]),
        "training/rollout_probs_diff_mean": Metric.token_mean(probs_diff, mask),
        "training/rollout_probs_diff_max": Metric.max(probs_diff[mask]),
    }


def compute_rollout_is_weights(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                               response_mask: torch.Tensor,
                               config: RolloutCorrectionConfig) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Truncated or masked importance weights ``w`` of ``rho = pi_old / q`` (see the module docstring).

    Args:
        old_log_prob: ``[b, t]`` the trainer's log-probs of the sampled tokens.
        rollout_log_prob: ``[b, t]`` the sampler's.
        response_mask: ``[b, t]`` 1 on the response tokens.
        config: Level, mode and thresholds (must be enabled).

    Returns:
        ``(weights [b, t], metrics)``: detached float32 weights, 0 off the mask; metrics
        ``rollout_corr/rollout_is_{mean, max, min}`` of the applied weights over the response tokens and
        ``rollout_corr/rollout_is_ratio_fraction_{high, low}`` (tokens, or for ``level="sequence"``
        sequences, whose ratio is above ``threshold`` / below ``threshold_lower``, or ``1 / threshold``
        when no lower bound is set, as verl reports it).
    """
    if not config.enabled:
        raise ValueError("compute_rollout_is_weights needs rollout_correction.level set "
                         "('token' or 'sequence')")
    mask = response_mask.bool()
    zero = torch.zeros((), device=old_log_prob.device)
    log_ratio = torch.where(mask, old_log_prob.detach().float() - rollout_log_prob.detach().float(), zero)
    if config.level == "sequence":
        log_ratio = masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1).expand_as(mask)
    ratio = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
    lower = config.threshold_lower if config.threshold_lower is not None else 0.0
    if config.mode == "truncate":
        weights = ratio.clamp(max=config.threshold)
    else:
        keep = (ratio <= config.threshold) & (ratio >= lower)
        weights = torch.where(keep, ratio, zero)
    weights = torch.where(mask, weights, zero)
    low_bound = config.threshold_lower if config.threshold_lower is not None else 1.0 / config.threshold
    high, low = (ratio > config.threshold).float(), (ratio < low_bound).float()
    if config.level == "sequence":
        rows = mask.any(dim=-1)
        fractions = {"high": _seq_mean(high[:, 0], rows), "low": _seq_mean(low[:, 0], rows)}
    else:
        fractions = {"high": Metric.token_mean(high, mask), "low": Metric.token_mean(low, mask)}
    metrics = {
        "rollout_corr/rollout_is_mean": Metric.token_mean(weights, mask),
        "rollout_corr/rollout_is_max": Metric.max(weights[mask]),
        "rollout_corr/rollout_is_min": Metric.min(weights[mask]),
        "rollout_corr/rollout_is_ratio_fraction_high": fractions["high"],
        "rollout_corr/rollout_is_ratio_fraction_low": fractions["low"],
    }
    return weights, metrics
