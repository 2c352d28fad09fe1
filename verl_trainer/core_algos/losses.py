"""The loss functions a driver hands to the engine: :func:`ppo_loss`, :func:`value_loss`, :func:`sft_loss`.

Each is a factory: built once from a typed, validated config, it returns a callable with the engine's
contract (:mod:`verl_trainer.core_algos.aggregation`)::

    loss_fn = ppo_loss(PPOLossConfig(clip_ratio=0.2, use_kl_loss=True))
    loss, metrics = loss_fn(model_output, micro_batch, global_batch_info)

* ``model_output``: ``"log_probs"`` ``[b, t]`` (+ ``"entropy"`` ``[b, t]``) or ``"values"`` ``[b, t]``,
  aligned with ``micro_batch["input_ids"]``.
* ``micro_batch``: a ``TensorDict`` (or mapping) with ``loss_mask`` and the keys each loss names below,
  all ``[b, t]``. Padding samples have an all-zero ``loss_mask`` and contribute nothing.
* ``global_batch_info``: the step's :class:`~verl_trainer.core_algos.aggregation.GlobalBatchInfo`; ``None``
  means one process and one micro-batch: :meth:`GlobalBatchInfo.from_batch` of the batch at hand, the
  engine's own definitions (a real sample with an all-zero loss mask counts in ``global_batch_size``).
* ``loss``: this micro-batch's partial loss (global denominators, ``x dp_size``); back-propagate as is.
* ``metrics``: ``{name: Metric}``; losses are ``SUM`` (partial values), ratios are token-weighted
  ``MEAN`` (see :mod:`verl_trainer.metrics`), so :func:`~verl_trainer.metrics.reduce_metrics` gives the
  same values for any micro-batching and dp/sp size.

verl 0.9.1's ``ppo_loss(config, model_output, data, dp_group)`` computes directly and mutates
``config.global_batch_info`` on every call; here the config is frozen and validated once, and the global
info is an argument.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from verl_trainer.core_algos.aggregation import (
    AGG_MODES,
    SEQ_MEAN_TOKEN_SUM_NORM,
    TOKEN_MEAN,
    GlobalBatchInfo,
    agg_loss,
    global_batch_kwargs,
)
from verl_trainer.core_algos.loss_rules import check_policy_loss_agg
from verl_trainer.core_algos.penalties import compute_value_loss, kl_penalty, validate_kl_penalty
from verl_trainer.core_algos.policy_losses import (
    POLICY_LOSS_REGISTRY,
    PREPARED_KEY,
    batch_preparer,
    get_policy_loss_fn,
)
from verl_trainer.core_algos.rollout_correction import (
    RolloutCorrectionConfig,
    compute_rollout_is_weights,
    rollout_mismatch_metrics,
)
from verl_trainer.data.schema import (
    ADVANTAGES,
    LOSS_MASK,
    OLD_LOG_PROBS,
    REF_LOG_PROB,
    RETURNS,
    ROLLOUT_LOG_PROBS,
    VALUES,
)
from verl_trainer.metrics import Metric
from verl_trainer.utils.registry import is_object_path

if TYPE_CHECKING:
    from tensordict import TensorDict

__all__ = [
    "PPOLoss",
    "PPOLossConfig",
    "SFTLoss",
    "SFTLossConfig",
    "ValueLoss",
    "ValueLossConfig",
    "ppo_loss",
    "sft_loss",
    "value_loss",
]

LossOutput = tuple[torch.Tensor, dict[str, Metric]]


def _check_agg(owner: str, loss_agg_mode: str, loss_scale_factor: float | None) -> None:
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(
            f"{owner}.loss_agg_mode={loss_agg_mode!r} is not valid; choose one of {', '.join(AGG_MODES)} "
            f"(e.g. loss_agg_mode='{TOKEN_MEAN}')."
        )
    if loss_agg_mode == SEQ_MEAN_TOKEN_SUM_NORM and loss_scale_factor is None:
        raise ValueError(
            f"{owner}.loss_agg_mode='{SEQ_MEAN_TOKEN_SUM_NORM}' (Dr.GRPO) needs a constant "
            "loss_scale_factor; got None. Set loss_scale_factor to the maximum response length (e.g. "
            "loss_scale_factor=data.max_response_length): verl's fallback, the padded width of each "
            "micro-batch, makes the loss depend on micro-batching."
        )
    if loss_scale_factor is not None and not loss_scale_factor > 0:
        raise ValueError(f"{owner}.loss_scale_factor must be > 0, got {loss_scale_factor!r}.")


@dataclass(frozen=True)
class PPOLossConfig:
    """Actor (policy) loss settings; verl's ``actor`` config names and defaults.

    Attributes:
        clip_ratio: PPO clip range epsilon.
        clip_ratio_low: Lower clip range (default ``clip_ratio``).
        clip_ratio_high: Upper clip range (default ``clip_ratio``; DAPO's clip-higher sets it larger).
        clip_ratio_c: Dual-clip bound for negative advantages (> 1).
        loss_agg_mode: See :func:`verl_trainer.core_algos.agg_loss`.
        policy_loss: A name in the policy-loss registry (``vanilla``, ``gspo``, ``gspo_token``, ``gpg``,
            ``geo_mean`` / ``gmpo``, ``cispo``, ``sapo``, ``dppo_tv``, ``dppo_kl``, ``clip_cov``, ``kl_cov``:
            docs/losses.md), or where one is defined: ``"package.module:name"``, ``"path/to/file.py:name"``.
        entropy_coeff: Weight of the entropy bonus (``loss -= entropy_coeff * entropy``); needs
            ``model_output["entropy"]`` when non-zero.
        use_kl_loss: Add ``kl_loss_coef * KL(pi || pi_ref)`` to the loss (needs ``ref_log_prob``).
        kl_loss_coef: Weight of the KL loss.
        kl_loss_type: KL estimator, see :func:`verl_trainer.core_algos.kl_penalty`.
        loss_scale_factor: The constant of ``seq-mean-token-sum-norm`` (required in that mode).
        tau_pos: SAPO's gate temperature for positive advantages (> 0).
        tau_neg: SAPO's gate temperature for negative advantages (> 0).
        clip_cov_ratio: Clip-Cov: the fraction of the step's tokens whose gradient is cut, in (0, 1].
        clip_cov_lb: Clip-Cov: candidates have a covariance above this ...
        clip_cov_ub: ... and below this.
        kl_cov_ratio: KL-Cov: the fraction of the step's tokens that get the KL penalty, in (0, 1].
        ppo_kl_coef: KL-Cov: the penalty's weight (>= 0).

    ``policy_loss`` and ``loss_agg_mode`` must fit (``core_algos/loss_rules.py``: a sequence-level ratio
    only in ``seq-mean-token-mean``).
    """

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = TOKEN_MEAN
    policy_loss: str = "vanilla"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    loss_scale_factor: float | None = None
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 1.0

    def __post_init__(self) -> None:
        _check_agg("PPOLossConfig", self.loss_agg_mode, self.loss_scale_factor)
        self._check_policy_loss()
        check_policy_loss_agg(self.policy_loss, get_policy_loss_fn(self.policy_loss), self.loss_agg_mode,
                              "PPOLossConfig")
        self._check_loss_parameters()
        self._post_init_rest()

    def _check_policy_loss(self) -> None:
        """``policy_loss`` is registered, or a ``module:name`` / ``file.py:name`` that loads."""
        if is_object_path(self.policy_loss):
            try:
                get_policy_loss_fn(self.policy_loss)  # loads it now: a missing file fails before any model
            except ValueError as err:
                raise ValueError(f"PPOLossConfig.policy_loss: {err}") from None
        elif self.policy_loss not in POLICY_LOSS_REGISTRY:
            raise ValueError(
                f"PPOLossConfig.policy_loss={self.policy_loss!r} is not registered; registered: "
                f"{POLICY_LOSS_REGISTRY.keys_repr()}. Use one of these, register yours with "
                "verl_trainer.core_algos.register_policy_loss, or name it as 'module:name' / 'file.py:name'."
            )

    def _check_loss_parameters(self) -> None:
        """The parameters of SAPO, Clip-Cov and KL-Cov (checked whatever the loss: a typo fails early)."""
        for name in ("tau_pos", "tau_neg"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PPOLossConfig.{name}={getattr(self, name)!r} must be > 0 (SAPO's gate "
                                 "temperature; the paper: tau_pos=1.0, tau_neg=1.05).")
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"PPOLossConfig.{name}={getattr(self, name)!r} must be in (0, 1] (the "
                                 "fraction of the step's tokens selected; the paper: 0.0002).")
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise ValueError(f"PPOLossConfig.clip_cov_lb={self.clip_cov_lb!r} must be < clip_cov_ub="
                             f"{self.clip_cov_ub!r} (Clip-Cov's covariance band; the paper: 1.0 and 5.0).")
        if not self.ppo_kl_coef >= 0:
            raise ValueError(f"PPOLossConfig.ppo_kl_coef={self.ppo_kl_coef!r} must be >= 0 (KL-Cov's penalty "
                             "weight; the paper: 1.0).")

    def _post_init_rest(self) -> None:
        """Clip ranges and the KL loss type."""
        if not self.clip_ratio > 0:
            raise ValueError(
                f"PPOLossConfig.clip_ratio must be > 0, got {self.clip_ratio!r} (verl default 0.2)."
            )
        for name in ("clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"PPOLossConfig.{name} must be >= 0 or None (= clip_ratio), got {value!r}.")
        if not self.clip_ratio_c > 1.0:
            raise ValueError(
                f"PPOLossConfig.clip_ratio_c must be > 1.0 (the dual-clip bound), got {self.clip_ratio_c!r} "
                "(verl default 3.0)."
            )
        try:
            validate_kl_penalty(self.kl_loss_type)
        except ValueError as err:
            raise ValueError(f"PPOLossConfig.kl_loss_type: {err}") from None


@dataclass(frozen=True)
class ValueLossConfig:
    """Critic loss settings (verl's ``critic`` names and defaults).

    Attributes:
        cliprange_value: Clip range of the value prediction around the rollout-time value.
        loss_agg_mode: See :func:`verl_trainer.core_algos.agg_loss`.
        loss_scale_factor: The constant of ``seq-mean-token-sum-norm`` (required in that mode).

    """

    cliprange_value: float = 0.5
    loss_agg_mode: str = TOKEN_MEAN
    loss_scale_factor: float | None = None

    def __post_init__(self) -> None:
        _check_agg("ValueLossConfig", self.loss_agg_mode, self.loss_scale_factor)
        if not self.cliprange_value >= 0:
            raise ValueError(f"ValueLossConfig.cliprange_value must be >= 0, got {self.cliprange_value!r}.")


@dataclass(frozen=True)
class SFTLossConfig:
    """SFT (negative log-likelihood) loss settings.

    Attributes:
        loss_agg_mode: See :func:`verl_trainer.core_algos.agg_loss` (verl: ``token-mean``).
        loss_scale_factor: The constant of ``seq-mean-token-sum-norm`` (required in that mode).

    """

    loss_agg_mode: str = TOKEN_MEAN
    loss_scale_factor: float | None = None

    def __post_init__(self) -> None:
        _check_agg("SFTLossConfig", self.loss_agg_mode, self.loss_scale_factor)


def _get(source: TensorDict | Mapping[str, torch.Tensor], key: str, who: str,
         shape: torch.Size | None = None) -> torch.Tensor:
    """``source[key]`` with an error naming the loss, the key and what is present."""
    if key not in source:
        present = sorted(str(k) for k in source.keys())
        raise KeyError(f"{who} needs {key!r} ([b, t]); present: {present}")
    value = source[key]
    if shape is not None and value.shape != shape:
        raise ValueError(
            f"{who}: {key!r} has shape {tuple(value.shape)}, expected {tuple(shape)} (= loss_mask)"
        )
    return value


class PPOLoss:
    """The actor loss: policy loss (registry) - entropy bonus + KL loss. Build with :func:`ppo_loss`.

    Reads ``micro_batch``: ``loss_mask``, ``old_log_probs``, ``advantages``, optionally
    ``rollout_log_probs`` and ``rollout_is_weights``, and ``ref_log_prob`` when ``use_kl_loss``. Metrics:
    the policy loss's (``actor/pg_clipfrac``, ``actor/ppo_kl``, ...), ``actor/pg_loss``; with entropy
    ``actor/entropy_loss`` (aggregated like the loss) and ``actor/entropy`` (token mean); with KL
    ``actor/kl_loss`` and ``actor/kl_coef``; with ``rollout_log_probs`` the train/inference mismatch
    (``rollout_corr/*``, ``training/rollout_probs_diff_*``:
    :func:`~verl_trainer.core_algos.rollout_correction.rollout_mismatch_metrics`, ``old_log_probs`` vs
    ``rollout_log_probs``) and, with ``rollout_correction`` enabled, the importance weights of
    :func:`~verl_trainer.core_algos.rollout_correction.compute_rollout_is_weights` passed to the policy
    loss as ``rollout_is_weights`` (and their ``rollout_corr/rollout_is_*`` metrics).

    Args:
        config: The policy loss settings.
        rollout_correction: TIS / MIS of the rollout -> trainer ratio; ``None``: off.
    """

    def __init__(self, config: PPOLossConfig,
                 rollout_correction: RolloutCorrectionConfig | None = None) -> None:
        self.config = config
        self.rollout_correction = rollout_correction or RolloutCorrectionConfig()
        self.corrects = self.rollout_correction.enabled  # a frozen config: read once, not per micro-batch
        self.policy_loss_fn = get_policy_loss_fn(config.policy_loss)
        self.preparer = batch_preparer(self.policy_loss_fn)

    @property
    def needs_prepare(self) -> bool:
        """Whether the policy loss reads a selection made over the whole step (clip-cov, KL-cov).

        Then :meth:`prepare` must see each mini-batch, with its ``old_log_probs``, before the engine splits
        it.
        """
        return self.preparer is not None

    def prepare(self, batch: TensorDict, dp_group: Any = None) -> TensorDict:
        """Add what the policy loss computes over the whole step (``policy_losses.set_batch_preparer``).

        Call it on this rank's whole mini-batch, on every DP rank (a collective over ``dp_group`` for a
        loss that has a preparer), before ``engine.train_batch``; a loss without one returns ``batch``
        unchanged. The result is stored under ``PREPARED_KEY`` ``[B, T]``, split with the batch.
        """
        if self.preparer is None:
            return batch
        batch = batch.clone(recurse=False)
        batch[PREPARED_KEY] = self.preparer(batch, self.config, dp_group)
        return batch

    def _rollout_terms(self, data: TensorDict | Mapping[str, torch.Tensor], old_log_prob: torch.Tensor,
                       mask: torch.Tensor) -> tuple[torch.Tensor | None, dict[str, Metric]]:
        """``(rollout_is_weights or None, mismatch + weight metrics)`` of one micro-batch."""
        weights = data.get("rollout_is_weights", None)
        correction = self.rollout_correction
        if ROLLOUT_LOG_PROBS not in data.keys():
            if self.corrects:
                raise KeyError(
                    f"ppo_loss: rollout_correction.level={correction.level!r} needs {ROLLOUT_LOG_PROBS!r} "
                    "([b, t]) in the batch (every built-in rollout sets it); "
                    "set rollout_correction.level=null"
                )
            return weights, {}
        rollout_log_prob = _get(data, ROLLOUT_LOG_PROBS, "ppo_loss", mask.shape)
        metrics = rollout_mismatch_metrics(old_log_prob, rollout_log_prob, mask)
        if not self.corrects:
            return weights, metrics
        if weights is not None:
            raise ValueError("ppo_loss: the batch carries 'rollout_is_weights' and rollout_correction is on; "
                             "use one or the other (set rollout_correction.level=null to use the batch's)")
        weights, is_metrics = compute_rollout_is_weights(old_log_prob, rollout_log_prob, mask, correction)
        metrics.update(is_metrics)
        return weights.to(old_log_prob.dtype), metrics

    def __call__(
        self, model_output: Mapping[str, torch.Tensor], data: TensorDict | Mapping[str, torch.Tensor],
        info: GlobalBatchInfo | None = None
    ) -> LossOutput:
        """Partial loss and metrics of one micro-batch (see the module docstring)."""
        cfg = self.config
        info = GlobalBatchInfo.from_batch(data) if info is None else info
        mask = _get(data, LOSS_MASK, "ppo_loss").bool()
        log_prob = _get(model_output, "log_probs", "ppo_loss (model_output)", mask.shape)
        agg_kwargs = global_batch_kwargs(info, cfg.loss_scale_factor)
        old_log_prob = _get(data, OLD_LOG_PROBS, "ppo_loss", mask.shape)
        rollout_is_weights, rollout_metrics = self._rollout_terms(data, old_log_prob, mask)
        prepared = {}
        if self.preparer is not None:
            if PREPARED_KEY not in data.keys():
                raise KeyError(
                    f"ppo_loss: policy_loss={cfg.policy_loss!r} selects tokens over the whole step and needs "
                    f"{PREPARED_KEY!r} in the batch: call loss_fn.prepare(mini_batch, dp_group) on each "
                    "rank's whole mini-batch before engine.train_batch (the RL recipes do)")
            prepared["prepared"] = _get(data, PREPARED_KEY, "ppo_loss", mask.shape)
        pg_loss, metrics = self.policy_loss_fn(
            old_log_prob=old_log_prob,
            log_prob=log_prob,
            advantages=_get(data, ADVANTAGES, "ppo_loss", mask.shape),
            response_mask=mask,
            loss_agg_mode=cfg.loss_agg_mode,
            config=cfg,
            rollout_is_weights=rollout_is_weights,
            global_batch_info=info,
            **prepared,
        )
        metrics = {**metrics, **rollout_metrics}
        metrics["actor/pg_loss"] = Metric.sum(pg_loss)
        loss = pg_loss
        entropy = model_output.get("entropy", None)
        if entropy is not None:
            entropy_loss = agg_loss(entropy, mask, cfg.loss_agg_mode, **agg_kwargs)
            metrics["actor/entropy_loss"] = Metric.sum(entropy_loss)
            metrics["actor/entropy"] = Metric.token_mean(entropy, mask)
            if cfg.entropy_coeff != 0:
                loss = loss - cfg.entropy_coeff * entropy_loss
        elif cfg.entropy_coeff != 0:
            raise KeyError(
                f"ppo_loss: entropy_coeff={cfg.entropy_coeff} needs model_output['entropy'] ([b, t]); "
                "ask the engine to compute entropy, or set entropy_coeff=0."
            )
        if cfg.use_kl_loss:
            ref_log_prob = _get(data, REF_LOG_PROB, "ppo_loss (use_kl_loss=True)", mask.shape)
            kld = kl_penalty(log_prob, ref_log_prob, cfg.kl_loss_type)
            kl_loss = agg_loss(kld, mask, cfg.loss_agg_mode, **agg_kwargs)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = Metric.sum(kl_loss)
            metrics["actor/kl_coef"] = Metric.mean(float(cfg.kl_loss_coef))
        return loss, metrics


class ValueLoss:
    """The clipped critic loss. Build with :func:`value_loss`.

    Reads ``model_output["values"]`` and ``micro_batch``: ``loss_mask``, ``values`` (rollout-time),
    ``returns``. Metrics: ``critic/vf_loss`` (SUM), ``critic/vf_clipfrac`` and ``critic/vpred_mean``
    (token means).
    """

    def __init__(self, config: ValueLossConfig) -> None:
        self.config = config

    def __call__(
        self, model_output: Mapping[str, torch.Tensor], data: TensorDict | Mapping[str, torch.Tensor],
        info: GlobalBatchInfo | None = None
    ) -> LossOutput:
        """Partial loss and metrics of one micro-batch (see the module docstring)."""
        cfg = self.config
        info = GlobalBatchInfo.from_batch(data) if info is None else info
        mask = _get(data, LOSS_MASK, "value_loss").bool()
        vpreds = _get(model_output, "values", "value_loss (model_output)", mask.shape)
        vf_loss, vf_clipfrac = compute_value_loss(
            vpreds=vpreds,
            returns=_get(data, RETURNS, "value_loss", mask.shape),
            values=_get(data, VALUES, "value_loss", mask.shape),
            response_mask=mask,
            cliprange_value=cfg.cliprange_value,
            loss_agg_mode=cfg.loss_agg_mode,
            **global_batch_kwargs(info, cfg.loss_scale_factor),
        )
        metrics = {
            "critic/vf_loss": Metric.sum(vf_loss),
            "critic/vf_clipfrac": Metric.mean(vf_clipfrac, weight=mask.sum()),
            "critic/vpred_mean": Metric.token_mean(vpreds, mask),
        }
        return vf_loss, metrics


class SFTLoss:
    """Negative log-likelihood of the ``loss_mask`` tokens. Build with :func:`sft_loss`.

    Metrics: ``sft/loss`` (SUM).
    """

    def __init__(self, config: SFTLossConfig) -> None:
        self.config = config

    def __call__(
        self, model_output: Mapping[str, torch.Tensor], data: TensorDict | Mapping[str, torch.Tensor],
        info: GlobalBatchInfo | None = None
    ) -> LossOutput:
        """Partial loss and metrics of one micro-batch (see the module docstring)."""
        cfg = self.config
        info = GlobalBatchInfo.from_batch(data) if info is None else info
        mask = _get(data, LOSS_MASK, "sft_loss").bool()
        log_prob = _get(model_output, "log_probs", "sft_loss (model_output)", mask.shape)
        agg_kwargs = global_batch_kwargs(info, cfg.loss_scale_factor)
        loss = agg_loss(-log_prob, mask, cfg.loss_agg_mode, **agg_kwargs)
        return loss, {"sft/loss": Metric.sum(loss)}


def ppo_loss(config: PPOLossConfig | None = None,
             rollout_correction: RolloutCorrectionConfig | None = None) -> PPOLoss:
    """Build the actor loss function for the engine from ``config`` (default: verl's defaults).

    ``rollout_correction``: truncated / masked importance sampling of the rollout -> trainer ratio
    (:class:`~verl_trainer.core_algos.rollout_correction.RolloutCorrectionConfig`; ``None``: off).
    """
    return PPOLoss(config if config is not None else PPOLossConfig(), rollout_correction)


def value_loss(config: ValueLossConfig | None = None) -> ValueLoss:
    """Build the critic loss function for the engine from ``config``."""
    return ValueLoss(config if config is not None else ValueLossConfig())


def sft_loss(config: SFTLossConfig | None = None) -> SFTLoss:
    """Build the SFT loss function for the engine from ``config``."""
    return SFTLoss(config if config is not None else SFTLossConfig())
