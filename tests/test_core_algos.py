"""core_algos: agg_loss modes (hand-computed and split-invariant), KL estimators, value loss, policy-loss
and advantage-estimator registries, estimators against hand-computed cases and a reference GAE loop."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_trainer import core_algos as ca
from verl_trainer.core_algos import (
    AGG_MODES,
    AdvantageEstimator,
    agg_loss,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_value_loss,
    get_adv_estimator_fn,
    get_policy_loss_fn,
    kl_penalty,
    register_policy_loss,
)
from verl_trainer.core_algos.aggregation import GlobalBatchInfo
from verl_trainer.metrics import reduce_metrics

# S = [3, 4, 0], n = [2, 1, 0]; the NaN sits in a masked-out position and must not leak.
LOSS = torch.tensor([[1.0, 2.0, 9.0], [4.0, float("nan"), 9.0], [5.0, 5.0, 5.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    "mode, kwargs, expected",
    [
        ("token-mean", {}, 7 / 3),
        ("token-mean", dict(dp_size=2, batch_num_tokens=10), 7 / 10 * 2),
        ("token-sum", {}, 7.0),
        ("token-sum", dict(dp_size=2), 14.0),
        ("seq-mean-token-sum", {}, 7 / 2),  # rows with tokens: 2
        ("seq-mean-token-sum", dict(dp_size=2, global_batch_size=4), 7 / 4 * 2),
        ("seq-mean-token-mean", {}, (1.5 + 4.0) / 2),
        ("seq-mean-token-mean", dict(dp_size=2, global_batch_size=5), 5.5 / 5 * 2),
        ("seq-mean-token-sum-norm", dict(loss_scale_factor=4), 7 / 2 / 4),
        ("seq-mean-token-sum-norm", dict(dp_size=4, global_batch_size=8, loss_scale_factor=2), 7 / 8 * 4 / 2),
    ],
)
def test_agg_loss_hand_computed(mode, kwargs, expected):
    assert agg_loss(LOSS, MASK, mode, **kwargs).item() == pytest.approx(expected, rel=1e-6)


def test_agg_loss_accepts_bool_mask_and_tensor_denominators():
    got = agg_loss(LOSS, MASK.bool(), "token-mean", dp_size=2, batch_num_tokens=torch.tensor(10))
    assert got.item() == pytest.approx(1.4)


@pytest.mark.parametrize("mode, missing", [("token-mean", "batch_num_tokens"),
                                           ("seq-mean-token-sum", "global_batch_size"),
                                           ("seq-mean-token-mean", "global_batch_size")])
def test_agg_loss_dp_without_global_denominator_raises(mode, missing):
    with pytest.raises(ValueError, match=missing):
        agg_loss(LOSS, MASK, mode, dp_size=2)


def test_agg_loss_errors():
    with pytest.raises(ValueError, match="loss_scale_factor"):  # global denominators: a constant is needed
        agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", global_batch_size=LOSS.shape[0])
    # a one-piece call keeps verl's fallback, the padded width
    width = LOSS.shape[-1]
    torch.testing.assert_close(agg_loss(LOSS, MASK, "seq-mean-token-sum-norm"),
                               agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=width))
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(LOSS, MASK, "mean")
    with pytest.raises(ValueError, match="dp_size"):
        agg_loss(LOSS, MASK, "token-mean", dp_size=0)


def test_agg_loss_empty_batch_is_zero_not_nan():
    for mode in AGG_MODES:
        out = agg_loss(LOSS, torch.zeros_like(MASK), mode, loss_scale_factor=3)
        assert out.item() == 0.0


@settings(max_examples=30, deadline=None)
@given(
    mode=st.sampled_from(AGG_MODES),
    dp=st.integers(1, 3),
    seed=st.integers(0, 10_000),
    micro=st.integers(1, 4),
)
def test_agg_loss_partial_sums_equal_one_shot(mode, dp, seed, micro):
    """Split into dp ranks x micro-batches: sum over micro-batches, mean over ranks == one piece."""
    g = torch.Generator().manual_seed(seed)
    b, t = 12, 7
    loss = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) > 0.4
    mask[torch.randint(0, b, (2,), generator=g)] = False  # padding samples
    kw = dict(batch_num_tokens=int(mask.sum()), global_batch_size=int(mask.any(-1).sum()),
              loss_scale_factor=5)
    ref = agg_loss(loss, mask, mode, **kw)
    total = 0.0
    for rank_idx in torch.tensor_split(torch.randperm(b, generator=g), dp):
        for mb in torch.tensor_split(rank_idx, micro):
            total += agg_loss(loss[mb], mask[mb], mode, dp_size=dp, **kw).item()
    assert total / dp == pytest.approx(ref.item(), rel=1e-9, abs=1e-12)


# --------------------------------------------------------------------------- KL estimators

LP = torch.tensor([-1.0, -0.5, -2.0, -0.1])
REF = torch.tensor([-1.2, -0.5, -1.0, -3.0])


@pytest.mark.parametrize(
    "names, expected",
    [
        (("kl", "k1"), LP - REF),
        (("abs",), (LP - REF).abs()),
        (("mse", "k2"), 0.5 * (LP - REF) ** 2),
        (("low_var_kl", "k3"), torch.exp(REF - LP) - (REF - LP) - 1),
    ],
)
def test_kl_penalty_values(names, expected):
    for name in names:
        torch.testing.assert_close(kl_penalty(LP, REF, name), expected)


def test_k3_is_clamped_like_verl():
    assert kl_penalty(torch.tensor([-40.0]), torch.tensor([0.0]), "k3").item() == 10.0


@pytest.mark.parametrize("name", ["k1+", "kl+", "abs+", "k3+", "low_var_kl+", "k2+", "mse+"])
def test_kl_plus_is_forward_value_with_k2_gradient(name):
    lp = LP.clone().requires_grad_(True)
    out = kl_penalty(lp, REF, name)
    torch.testing.assert_close(out.detach(), kl_penalty(LP, REF, name[:-1]))
    (grad,) = torch.autograd.grad(out.sum(), lp)
    torch.testing.assert_close(grad, LP - REF)  # d/dlp of 0.5 (lp - ref)^2


def test_kl_penalty_unknown_lists_choices():
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(LP, REF, "full")


# --------------------------------------------------------------------------- value loss


def test_value_loss_hand_computed_and_clipfrac():
    vpreds = torch.tensor([[1.0, 0.0, 5.0]])
    values = torch.tensor([[0.0, 0.0, 0.0]])
    returns = torch.tensor([[2.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    # token 0: unclipped (1-2)^2=1, clipped (0.5-2)^2=2.25 -> 2.25 (clipped); token 1: 1 vs 1 -> 1
    loss, clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.5)
    assert loss.item() == pytest.approx(0.5 * (2.25 + 1) / 2)
    assert clipfrac.item() == pytest.approx(0.5)
    loss_dp, _ = compute_value_loss(vpreds, returns, values, mask, 0.5, "token-mean",
                                    dp_size=2, batch_num_tokens=4)
    assert loss_dp.item() == pytest.approx(0.5 * 3.25 / 4 * 2)


# --------------------------------------------------------------------------- policy losses


def test_vanilla_dual_clip_hand_computed():
    # ratios 1.5 (A=+1, clipped high), 0.5 (A=+1, not clipped), 1.5 (A=-1), 4.0 (A=-1, dual-clipped at c=3)
    ratio = torch.tensor([[1.5, 0.5, 1.5, 4.0]])
    old = torch.zeros(1, 4)
    lp = ratio.log().requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    cfg = dict(clip_ratio=0.2, clip_ratio_c=3.0)
    loss, metrics = get_policy_loss_fn("vanilla")(old, lp, adv, mask, "token-sum", cfg)
    assert loss.item() == pytest.approx(-1.2 - 0.5 + 1.5 + 3.0, rel=1e-6)
    m = reduce_metrics([metrics])
    assert m["actor/pg_clipfrac"] == pytest.approx(1 / 4)
    assert m["actor/pg_clipfrac_lower"] == pytest.approx(1 / 4)
    assert m["actor/ppo_kl"] == pytest.approx(-float(ratio.log().mean()), rel=1e-6)
    (grad,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.5, 1.5, 0.0]]))  # clipped tokens: no gradient
    # DAPO clip-higher: the upper bound moves to 1 + 0.28
    hi_cfg = dict(cfg, clip_ratio_high=0.28)
    loss_hi, _ = get_policy_loss_fn("vanilla")(old, lp, adv, mask, "token-sum", hi_cfg)
    assert loss_hi.item() == pytest.approx(-1.28 - 0.5 + 1.5 + 3.0, rel=1e-6)


def test_gspo_gpg_geo_mean_at_ratio_one():
    g = torch.Generator().manual_seed(1)
    lp = (-torch.rand(3, 5, generator=g)).requires_grad_(True)
    adv = torch.randn(3, 1, generator=g).expand(3, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 0, 0, 0]])
    n = mask.sum(-1)
    seq_mean_adv = (adv * mask).sum(-1) / n
    cfg = dict(clip_ratio=0.2)
    gspo, _ = get_policy_loss_fn("gspo")(lp.detach(), lp, adv, mask, "token-mean", cfg)
    assert gspo.item() == pytest.approx(-seq_mean_adv.mean().item(), rel=1e-6)
    (grad,) = torch.autograd.grad(gspo, lp)
    torch.testing.assert_close(grad, -adv * mask / n[:, None] / 3)
    geo, _ = get_policy_loss_fn("geo_mean")(lp.detach(), lp, adv, mask, "token-mean", cfg)
    assert geo.item() == pytest.approx(-seq_mean_adv.mean().item(), rel=1e-6)
    gpg, metrics = get_policy_loss_fn("gpg")(lp.detach(), lp, adv, mask, "token-mean", cfg)
    torch.testing.assert_close(gpg, agg_loss(-lp * adv, mask, "token-mean"))
    assert metrics == {}


@pytest.mark.parametrize("name", ["vanilla", "gspo", "gpg", "geo_mean"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_every_policy_loss_uses_global_denominators(name, mode):
    """No policy loss takes a local mean: dp=2 x 2 micro-batches each equals the one-shot loss."""
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(8, 6, generator=g)
    lp = old + 0.3 * torch.randn(8, 6, generator=g)
    adv = torch.randn(8, 1, generator=g).expand(8, 6)
    mask = torch.rand(8, 6, generator=g) > 0.3
    mask[5] = False
    cfg = dict(clip_ratio=0.2, loss_scale_factor=6)
    full = GlobalBatchInfo(1, int(mask.sum()), int(mask.any(-1).sum()))
    fn = get_policy_loss_fn(name)
    ref, _ = fn(old, lp, adv, mask, mode, cfg, global_batch_info=full)
    total = 0.0
    for rank in range(2):
        info = GlobalBatchInfo(2, full.batch_num_tokens, full.global_batch_size, rank)
        for mb in ([0, 1, 2], [3]) if rank == 0 else ([4, 5], [6, 7]):
            total += fn(old[mb], lp[mb], adv[mb], mask[mb], mode, cfg, global_batch_info=info)[0].item()
    assert total / 2 == pytest.approx(ref.item(), rel=1e-6, abs=1e-7)


def test_policy_loss_registry():
    assert set(ca.POLICY_LOSS_REGISTRY.keys()) >= {"vanilla", "gspo", "gpg", "geo_mean"}
    with pytest.raises(ValueError, match="'gspo'"):
        get_policy_loss_fn("ppo2")
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("vanilla")(lambda *a, **k: None)

    @register_policy_loss("test_custom")
    def custom(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
               rollout_is_weights=None, global_batch_info=None):
        return agg_loss(-log_prob, response_mask, loss_agg_mode), {}

    try:
        assert get_policy_loss_fn("test_custom") is custom
    finally:
        ca.POLICY_LOSS_REGISTRY.remove("test_custom")


def test_vanilla_rejects_bad_dual_clip():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        get_policy_loss_fn("vanilla")(x, x, x, x + 1, "token-mean", dict(clip_ratio_c=0.5))


# --------------------------------------------------------------------------- advantage estimators


def _gae_reference(rewards, values, mask, gamma, lam):
    """Textbook GAE over each row's masked positions (in order), whitened over all of them."""
    adv = torch.zeros_like(values, dtype=torch.float64)
    for i in range(values.shape[0]):
        pos = mask[i].nonzero().flatten().tolist()
        r = [float(rewards[i, p]) for p in pos]
        v = [float(values[i, p]) for p in pos] + [0.0]
        running = 0.0
        for k in reversed(range(len(pos))):
            delta = r[k] + gamma * v[k + 1] - v[k]
            running = delta + gamma * lam * running
            adv[i, pos[k]] = running
    returns = (adv + values.double()) * mask
    sel = adv[mask.bool()]
    whitened = (adv - sel.mean()) / torch.sqrt(sel.var(unbiased=True) + 1e-8) * mask
    return whitened, returns


def test_gae_matches_reference_loop_with_prompt_and_padding_positions():
    g = torch.Generator().manual_seed(3)
    b, t = 4, 9
    mask = torch.zeros(b, t)
    for i, (start, length) in enumerate([(2, 5), (1, 8), (3, 1), (4, 3)]):
        mask[i, start:start + length] = 1
    values = torch.randn(b, t, generator=g, dtype=torch.float64)  # garbage outside the mask on purpose
    rewards = torch.randn(b, t, generator=g, dtype=torch.float64)
    adv, ret = compute_gae_advantage_return(rewards, values, mask.double(), gamma=0.9, lam=0.8)
    ref_adv, ref_ret = _gae_reference(rewards, values, mask.double(), 0.9, 0.8)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)
    assert get_adv_estimator_fn("gae") is compute_gae_advantage_return
    assert get_adv_estimator_fn(AdvantageEstimator.GAE) is compute_gae_advantage_return


@pytest.mark.parametrize("index", [np.array(["a", "a", "b", "b", "c"], dtype=object),
                                   torch.tensor([7, 7, 3, 3, 9]), [0, 0, 1, 1, 2]])
def test_grpo_hand_computed(index):
    rewards = torch.zeros(5, 3)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 1.0, 2.0])  # outcome reward on the last token
    mask = torch.ones(5, 3)
    mask[0, 2] = 0
    adv, ret = compute_grpo_outcome_advantage(rewards, mask, index)
    s = 0.5 / (math.sqrt(0.5) + 1e-6)
    expected = torch.tensor([s, -s, 0.0, 0.0, 2.0 / (1 + 1e-6)])[:, None] * mask
    torch.testing.assert_close(adv, expected)
    assert adv is ret or torch.equal(adv, ret)
    drgrpo, _ = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(drgrpo, torch.tensor([0.5, -0.5, 0.0, 0.0, 2.0])[:, None] * mask)


def test_rloo_hand_computed():
    rewards = torch.tensor([[1.0], [2.0], [6.0], [5.0]])
    adv, _ = compute_rloo_outcome_advantage(rewards, torch.ones(4, 1), np.array([0, 0, 0, 1]))
    # leave-one-out: 1 - (2+6)/2, 2 - (1+6)/2, 6 - (1+2)/2; a group of one keeps its raw score
    torch.testing.assert_close(adv.flatten(), torch.tensor([-3.0, -1.5, 4.5, 5.0]))


def test_reinforce_plus_plus_hand_computed():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config={"gamma": 0.5})
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]]))
    sel = torch.tensor([0.25, 0.5, 1.0, 2.0])
    expected = (ret - sel.mean()) / torch.sqrt(sel.var() + 1e-8) * mask
    torch.testing.assert_close(adv, expected)
    with pytest.raises(ValueError, match="gamma"):
        compute_reinforce_plus_plus_outcome_advantage(rewards, mask)


def test_remax_hand_computed():
    rewards = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = compute_remax_outcome_advantage(rewards, torch.tensor([1.0, 0.5]), mask)
    torch.testing.assert_close(ret, torch.tensor([[3.0, 3.0, 2.0], [3.0, 0.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[2.0, 2.0, 1.0], [2.5, -0.5, 0.0]]))


def test_adv_estimator_registry():
    for name in ("gae", "grpo", "rloo", "reinforce_plus_plus", "remax"):
        assert callable(get_adv_estimator_fn(name))
    assert get_adv_estimator_fn(AdvantageEstimator.GRPO) is compute_grpo_outcome_advantage
    with pytest.raises(ValueError, match="'grpo'"):
        get_adv_estimator_fn("grp0")
    with pytest.raises(ValueError, match="already registered"):
        ca.register_adv_est("grpo")(lambda: None)
