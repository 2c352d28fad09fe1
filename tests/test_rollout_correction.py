"""Train/inference mismatch correction: hand-computed TIS / MIS weights, the identity when the rollout's
log-probs are the trainer's, the mismatch metrics' formulas, and clear config errors."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

from verl_trainer.core_algos import (
    RolloutCorrectionConfig,
    compute_rollout_is_weights,
    rollout_mismatch_metrics,
)
from verl_trainer.core_algos.losses import PPOLossConfig, ppo_loss
from verl_trainer.metrics import reduce_metrics

# two rows of 4 positions; row 0 trains positions 1..3, row 1 positions 0..3
MASK = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
RATIOS = torch.tensor([[1.0, 3.0, 0.5, 1.5], [1.2, 0.8, 1.0, 1.0]])  # pi_old / q per token
ROLLOUT = torch.tensor([[-1.0, -2.0, -0.5, -1.5], [-0.7, -0.3, -2.5, -1.1]])
OLD = ROLLOUT + RATIOS.log()


def weights(**kwargs) -> torch.Tensor:
    w, _ = compute_rollout_is_weights(OLD, ROLLOUT, MASK, RolloutCorrectionConfig(**kwargs))
    return w


def test_token_truncate_is_min_of_ratio_and_threshold():
    want = torch.tensor([[0.0, 2.0, 0.5, 1.5], [1.2, 0.8, 1.0, 1.0]])
    torch.testing.assert_close(weights(level="token", threshold=2.0), want)


def test_token_mask_zeroes_ratios_outside_the_bounds():
    want = torch.tensor([[0.0, 0.0, 0.0, 1.5], [1.2, 0.8, 1.0, 1.0]])
    torch.testing.assert_close(weights(level="token", mode="mask", threshold=2.0, threshold_lower=0.6), want)
    # TRL's combined value sets level and mode; no lower bound by default
    want_no_lower = torch.tensor([[0.0, 0.0, 0.5, 1.5], [1.2, 0.8, 1.0, 1.0]])
    torch.testing.assert_close(weights(level="token_mask", threshold=2.0), want_no_lower)


def test_sequence_level_uses_the_product_over_the_response():
    # row 0: 3 * 0.5 * 1.5 = 2.25 (position 0 is off the mask); row 1: 1.2 * 0.8 = 0.96
    truncated = weights(level="sequence", threshold=2.0)
    torch.testing.assert_close(truncated, torch.tensor([[0.0, 2.0, 2.0, 2.0], [0.96] * 4]))
    masked = weights(level="sequence_mask", threshold=2.0)
    torch.testing.assert_close(masked, torch.tensor([[0.0] * 4, [0.96] * 4]))


def test_weight_metrics():
    _, metrics = compute_rollout_is_weights(OLD, ROLLOUT, MASK, RolloutCorrectionConfig(level="token"))
    got = reduce_metrics([metrics])
    want_mean = (2.0 + 0.5 + 1.5 + 1.2 + 0.8 + 1 + 1) / 7
    assert math.isclose(got["rollout_corr/rollout_is_mean"], want_mean, rel_tol=1e-6)
    assert got["rollout_corr/rollout_is_max"] == pytest.approx(2.0)
    assert got["rollout_corr/rollout_is_min"] == pytest.approx(0.5)
    assert got["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 7)  # 3.0 > 2
    assert got["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(0.0)  # nothing < 1/2


def test_mismatch_metrics_formulas():
    got = reduce_metrics([rollout_mismatch_metrics(OLD, ROLLOUT, MASK)])
    m = MASK
    lr = RATIOS.log()
    assert got["rollout_corr/kl"] == pytest.approx(float(-lr[m].mean()), rel=1e-5)
    assert got["rollout_corr/k3_kl"] == pytest.approx(float((RATIOS - lr - 1)[m].mean()), rel=1e-5)
    assert got["rollout_corr/log_prob_abs_diff_mean"] == pytest.approx(float(lr.abs()[m].mean()), rel=1e-5)
    assert got["rollout_corr/log_prob_abs_diff_max"] == pytest.approx(math.log(3.0), rel=1e-5)
    probs = (OLD.exp() - ROLLOUT.exp()).abs()
    assert got["training/rollout_probs_diff_max"] == pytest.approx(float(probs[m].max()), rel=1e-5)
    mean_old = torch.stack([OLD[i][m[i]].mean() for i in range(2)])
    mean_q = torch.stack([ROLLOUT[i][m[i]].mean() for i in range(2)])
    assert got["rollout_corr/training_ppl"] == pytest.approx(float((-mean_old).exp().mean()), rel=1e-5)
    assert got["rollout_corr/rollout_ppl"] == pytest.approx(float((-mean_q).exp().mean()), rel=1e-5)
    assert got["rollout_corr/ppl_ratio"] == pytest.approx(float((mean_q - mean_old).exp().mean()), rel=1e-5)
    assert got["rollout_corr/log_ppl_diff_max"] == pytest.approx(float((mean_q - mean_old).max()), rel=1e-5)


def _batch(rollout: torch.Tensor) -> tuple[TensorDict, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    data = TensorDict({"loss_mask": MASK.float(), "old_log_probs": OLD,
                       "advantages": torch.randn(2, 1, generator=g).expand(2, 4) * MASK,
                       "rollout_log_probs": rollout, "is_padding": torch.zeros(2, dtype=torch.bool)},
                      batch_size=[2])
    return data, {"log_probs": (OLD + 0.1 * torch.randn(2, 4, generator=g)).requires_grad_(True)}


@pytest.mark.parametrize("level", ["token", "sequence", "token_mask", "sequence_mask"])
def test_correction_is_the_identity_when_the_rollout_is_the_trainer(level):
    data, out = _batch(OLD.clone())
    plain_loss, _ = ppo_loss(PPOLossConfig())(out, data)
    loss, metrics = ppo_loss(PPOLossConfig(), RolloutCorrectionConfig(level=level))(out, data)
    torch.testing.assert_close(loss, plain_loss)
    torch.testing.assert_close(torch.autograd.grad(loss, out["log_probs"])[0],
                               torch.autograd.grad(plain_loss, out["log_probs"])[0])
    got = reduce_metrics([metrics])
    assert got["rollout_corr/rollout_is_mean"] == 1.0
    assert got["rollout_corr/kl"] == 0.0 and got["rollout_corr/log_prob_abs_diff_max"] == 0.0
    assert got["rollout_corr/ppl_ratio"] == 1.0


def test_loss_is_weighted_by_the_truncated_ratio():
    data, out = _batch(ROLLOUT)
    loss, _ = ppo_loss(PPOLossConfig(), RolloutCorrectionConfig(level="token", threshold=2.0))(out, data)
    data["rollout_is_weights"] = torch.tensor([[0.0, 2.0, 0.5, 1.5], [1.2, 0.8, 1.0, 1.0]])
    want, _ = ppo_loss(PPOLossConfig())(out, data)  # the same weights handed in verl's way
    torch.testing.assert_close(loss, want)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(level="tok"), "token_truncate"),
    (dict(level="token", mode="clip"), "truncate"),
    (dict(level="token", threshold=0.0), "threshold"),
    (dict(level="token", threshold_lower=0.5), "mode=mask"),
    (dict(level="token", mode="mask", threshold=2.0, threshold_lower=3.0), "threshold_lower"),
])
def test_config_errors_name_the_value_and_the_choices(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        RolloutCorrectionConfig(**kwargs)


def test_correction_without_rollout_log_probs_is_a_clear_error():
    data, out = _batch(ROLLOUT)
    del data["rollout_log_probs"]
    with pytest.raises(KeyError, match="rollout_log_probs"):
        ppo_loss(PPOLossConfig(), RolloutCorrectionConfig(level="token"))(out, data)
