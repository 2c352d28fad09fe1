"""The version-fields block of the invariance matrix: a batch as the asynchronous rollout with partial
rollouts makes it, and the decoupled objective on it.

Every sample carries ``policy_version`` ``[B]`` (its oldest token's version) and every response token
``token_policy_version`` ``[B, T]`` (``-1`` elsewhere), versions rising along a response as partial
rollouts make them (:mod:`verl_trainer.algorithms.partial_rollout`). The behaviour log-probs
``rollout_log_probs`` are those of mixed versions: ``old_log_probs + BEHAVIOUR_SHIFT[version]`` per token,
so the rollout -> trainer ratios are ``e^1, e^-0.2, e^-1`` (2.7, 0.82, 0.37: truncated, kept, kept at the
threshold 2) and change along a response where its version changes.

The loss (``ppo_ver``) is the PPO loss with token-level truncated IS of the behaviour/proximal ratio (the
decoupled objective as the trainer runs it) plus the step's version statistics, declared with global
denominators: ``versions/token_staleness`` (token mean of ``STEP - token_policy_version`` over the loss
tokens), ``versions/sample_version`` (mean of ``policy_version`` over samples with a loss token, weighted by
them), ``versions/sample_version_max``. A version field that did not travel with its sample through
balancing, padding or micro-batching changes these metrics; one misaligned with its row's response
raises.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from verl_trainer.algorithms.async_rollout import POLICY_VERSION, TOKEN_POLICY_VERSION
from verl_trainer.core_algos import RolloutCorrectionConfig
from verl_trainer.core_algos.losses import PPOLossConfig, ppo_loss
from verl_trainer.metrics import Metric

STEP = 3
"""The step the batch trains at (``max_staleness = 2``: versions in ``[1, 3]``)."""
FIRST_VERSIONS = (1, 2, 3)
"""A sample's first-token version cycles through these (``row % 3``)."""
CHUNK_TOKENS = 4
"""Response tokens per partial-rollout chunk: the version may rise by one at each chunk boundary."""
BEHAVIOUR_SHIFT = {1: -1.0, 2: 0.2, 3: 1.0}
"""``rollout_log_probs - old_log_probs`` of a token sampled by each version."""


def version_batch(batch: TensorDict) -> TensorDict:
    """``batch`` with the version fields and behaviour log-probs of mixed versions (module docstring).

    Row ``i``'s response token ``j`` has version ``min(FIRST_VERSIONS[i % 3] + j // CHUNK_TOKENS, STEP)``.
    """
    batch = batch.clone()
    b, t = batch["input_ids"].shape
    first = torch.tensor([FIRST_VERSIONS[i % len(FIRST_VERSIONS)] for i in range(b)])
    start = batch["prompt_len"].view(-1, 1)
    offset = torch.arange(t).view(1, -1) - start
    response = (offset >= 0) & (offset < batch["response_len"].view(-1, 1))
    rising = (first.view(-1, 1) + offset.clamp_min(0) // CHUNK_TOKENS).clamp_max(STEP)
    versions = torch.where(response, rising, torch.full_like(rising, -1))
    batch[POLICY_VERSION] = first.long()
    batch[TOKEN_POLICY_VERSION] = versions.long()
    shift = torch.zeros(b, t)
    for version, value in BEHAVIOUR_SHIFT.items():
        shift = torch.where(versions == version, torch.tensor(value), shift)
    batch["rollout_log_probs"] = (batch["old_log_probs"] + shift) * batch["response_mask"]
    return batch


class VersionedPPOLoss:
    """The ``ppo_ver`` loss: PPO with token TIS (threshold 2), entropy bonus and KL loss, plus the version
    metrics of the module docstring.

    Raises:
        ValueError: In a micro-batch, a loss token whose ``token_policy_version`` is -1 or below its row's
            ``policy_version`` (the fields did not travel with their sample).
    """

    def __init__(self, agg: str, factor: float | None) -> None:
        self.inner = ppo_loss(PPOLossConfig(loss_agg_mode=agg, entropy_coeff=0.01, use_kl_loss=True,
                                            kl_loss_coef=0.1, kl_loss_type="low_var_kl",
                                            loss_scale_factor=factor),
                              RolloutCorrectionConfig(level="token", threshold=2.0))

    def __call__(self, model_output: Any, data: Any,
                 info: Any = None) -> tuple[torch.Tensor, dict[str, Metric]]:
        loss, metrics = self.inner(model_output, data, info)
        mask = data["loss_mask"].bool()
        tokens, first = data[TOKEN_POLICY_VERSION], data[POLICY_VERSION]
        if ((tokens < first.view(-1, 1)) & mask).any():
            raise ValueError("ppo_ver: a loss token's token_policy_version is -1 or below its row's "
                             "policy_version: the version fields did not travel with their samples")
        metrics["versions/token_staleness"] = Metric.token_mean((STEP - tokens).to(loss.dtype), mask)
        trained = mask.any(-1)
        count = trained.sum()
        mean = (first * trained).sum().to(loss.dtype) / count.clamp_min(1)
        metrics["versions/sample_version"] = Metric.mean(mean, weight=count)
        metrics["versions/sample_version_max"] = Metric.max(
            torch.where(trained, first, torch.zeros_like(first)).max().to(loss.dtype))
        return loss, metrics
