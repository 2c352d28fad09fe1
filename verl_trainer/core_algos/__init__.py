"""Core RL algorithms: loss aggregation, policy losses, KL estimators, value loss, advantage estimators.

Names, argument order and results follow verl 0.9.1 (``verl.trainer.ppo.core_algos``) so that verl
code ports over and numbers compare one for one. Where verl depends on how the batch is split (local
denominators, a padded-width default), the signature is kept and the behaviour fixed; each such place
says so in its docstring. The package's modules:

* ``aggregation``: the step's global denominators (:class:`GlobalBatchInfo`, the engine-loss contract),
  :func:`agg_loss` (global denominators, ``x dp_size``), masked reductions.
* ``penalties``: :func:`kl_penalty` (k1/kl, abs, k2/mse, k3/low_var_kl, ``+`` straight-through),
  :func:`compute_value_loss`.
* ``policy_losses``: :func:`register_policy_loss` / :func:`get_policy_loss_fn` with ``vanilla``
  (dual-clip PPO, clip-higher), ``gspo``, ``gpg``, ``geo_mean`` / ``gmpo`` (GMPO); ``ratio_losses``:
  ``gspo_token``, ``cispo``, ``sapo``, ``dppo_tv``, ``dppo_kl``; ``covariance_losses``: ``clip_cov``,
  ``kl_cov`` (token selection over the whole step); ``loss_rules``: the aggregation modes each accepts.
* ``rollout_correction``: train/inference mismatch metrics and truncated / masked importance sampling
  of the rollout -> trainer ratio (:class:`RolloutCorrectionConfig`).
* ``advantages``: :func:`register_adv_est` / :func:`get_adv_estimator_fn` with ``gae``, ``grpo``,
  ``rloo`` (also under verl's ``grpo_vectorized`` / ``rloo_vectorized``), ``reinforce_plus_plus``,
  ``remax``; ``outcome_estimators``: ``opo``, ``gpg``, ``pass_at_k``, ``grpo_passk``,
  ``reinforce_plus_plus_baseline``. Both registries are dict-like; like verl's, ``ADV_ESTIMATOR_REGISTRY``
  may be rebound to a dict of one's own (``core_algos.ADV_ESTIMATOR_REGISTRY = {...}``) and the functions
  use the new one.
* ``losses``: the engine's loss functions built from typed configs (:func:`ppo_loss`, :func:`value_loss`,
  :func:`sft_loss`); imported from their module, not re-exported here.
* ``balancing``: workload partitions (verl's ``seqlen_balancing``) and the step's samples re-partitioned
  over the DP ranks (``balance_batch``); ``karmarkar_karp``: the fast Karmarkar-Karp kernel behind it.
  Imported from their modules, not re-exported here.
"""

from __future__ import annotations

from verl_trainer.core_algos.advantages import (
    ADV_ESTIMATOR_REGISTRY,
    AdvantageEstimator,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_grpo_vectorized_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage,
    get_adv_estimator_fn,
    register_adv_est,
)
from verl_trainer.core_algos.aggregation import (
    AGG_MODES,
    GlobalBatchInfo,
    agg_loss,
    global_batch_kwargs,
    masked_mean,
    masked_sum,
    masked_whiten,
)
from verl_trainer.core_algos.covariance_losses import (
    compute_policy_loss_clip_cov,
    compute_policy_loss_kl_cov,
)
from verl_trainer.core_algos.outcome_estimators import (
    compute_gpg_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_pass_at_k_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
)
from verl_trainer.core_algos.penalties import (
    KL_PENALTY_TYPES,
    compute_value_loss,
    kl_penalty,
    validate_kl_penalty,
)
from verl_trainer.core_algos.policy_losses import (
    POLICY_LOSS_REGISTRY,
    PolicyLossFn,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_vanilla,
    get_policy_loss_fn,
    register_policy_loss,
)
from verl_trainer.core_algos.ratio_losses import (
    compute_policy_loss_cispo,
    compute_policy_loss_dppo_kl,
    compute_policy_loss_dppo_tv,
    compute_policy_loss_gspo_token,
    compute_policy_loss_sapo,
)
from verl_trainer.core_algos.rollout_correction import (
    RolloutCorrectionConfig,
    compute_rollout_is_weights,
    rollout_mismatch_metrics,
)

__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "AGG_MODES",
    "KL_PENALTY_TYPES",
    "POLICY_LOSS_REGISTRY",
    "AdvantageEstimator",
    "GlobalBatchInfo",
    "PolicyLossFn",
    "RolloutCorrectionConfig",
    "agg_loss",
    "compute_gae_advantage_return",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_pass_at_k_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_gspo_token",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_sapo",
    "compute_policy_loss_vanilla",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_rollout_is_weights",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_value_loss",
    "get_adv_estimator_fn",
    "get_policy_loss_fn",
    "global_batch_kwargs",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "register_adv_est",
    "register_policy_loss",
    "rollout_mismatch_metrics",
    "validate_kl_penalty",
]
