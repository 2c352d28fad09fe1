"""GSPO (sequence and token), CISPO, SAPO, DPPO: hand-computed values and gradients, TRL's numbers, the
(loss, aggregation mode) rules and the global denominators."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from verl_trainer.core_algos import GlobalBatchInfo, agg_loss, get_policy_loss_fn
from verl_trainer.core_algos.losses import PPOLossConfig

MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def inputs(seed: int = 0, token_adv: bool = False):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 6, generator=g) - 0.1
    lp = (old + 0.3 * torch.randn(4, 6, generator=g)).requires_grad_(True)
    adv = torch.randn(4, 1, generator=g).expand(4, 6).clone()
    if token_adv:
        adv = adv + torch.randn(4, 6, generator=g)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[0, 4:] = False
    mask[2, 1:] = False
    return old, lp, adv, mask


def loss_and_grad(name, old, lp, adv, mask, mode, cfg):
    loss, metrics = get_policy_loss_fn(name)(old, lp, adv, mask, mode, cfg)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss, grad, metrics


def test_gspo_sequence_variant_is_the_papers_formula():
    old, lp, adv, mask = inputs(token_adv=True)
    cfg = dict(clip_ratio_low=0.05, clip_ratio_high=0.08)
    loss, grad, _ = loss_and_grad("gspo", old, lp, adv, mask, "seq-mean-token-mean", cfg)
    n = mask.sum(-1)
    s = torch.exp(((lp - old) * mask).sum(-1) / n)
    a = (adv * mask).sum(-1) / n
    want = torch.maximum(-a * s, -a * s.clamp(0.95, 1.08)).mean()
    (want_grad,) = torch.autograd.grad(want, lp)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(grad, want_grad)


def test_gspo_variants_agree_on_sequence_advantages_and_differ_on_token_advantages():
    cfg = dict(clip_ratio_low=0.05, clip_ratio_high=0.08)
    old, lp, adv, mask = inputs()
    seq = loss_and_grad("gspo", old, lp, adv, mask, "seq-mean-token-mean", cfg)
    tok = loss_and_grad("gspo_token", old, lp, adv, mask, "seq-mean-token-mean", cfg)
    torch.testing.assert_close(seq[0], tok[0])
    torch.testing.assert_close(seq[1], tok[1])
    old, lp, adv, mask = inputs(token_adv=True)
    seq = loss_and_grad("gspo", old, lp, adv, mask, "seq-mean-token-mean", cfg)
    tok = loss_and_grad("gspo_token", old, lp, adv, mask, "seq-mean-token-mean", cfg)
    assert not torch.allclose(seq[1], tok[1])
    # GSPO-token: each token's gradient is its own advantage times the sequence ratio (unclipped tokens)
    n = mask.sum(-1, keepdim=True)
    s = torch.exp(((lp - old) * mask).sum(-1, keepdim=True) / n).detach()
    inside = ((s > 0.95) & (s < 1.08)) | ((adv > 0) & (s <= 0.95)) | ((adv < 0) & (s >= 1.08))
    torch.testing.assert_close(tok[1], -(adv * s * inside * mask) / n / 4)


def test_cispo_is_reinforce_weighted_by_the_clipped_detached_ratio():
    old, lp, adv, mask = inputs(token_adv=True)
    cfg = dict(clip_ratio_low=1.0, clip_ratio_high=0.1)  # MiniMax-M1: no lower bound
    loss, grad, metrics = loss_and_grad("cispo", old, lp, adv, mask, "token-mean", cfg)
    ratio = torch.exp(lp - old).detach()
    weight = ratio.clamp(max=1.1)
    n = mask.sum()
    torch.testing.assert_close(loss, (-(weight * adv * lp) * mask).sum() / n)
    torch.testing.assert_close(grad, -(weight * adv) * mask / n)
    assert float(metrics["actor/pg_clipfrac"].value) == pytest.approx(float(((ratio > 1.1) & mask).sum() / n))


def test_sapo_gate_value_and_on_policy_gradient():
    old, lp, adv, mask = inputs(token_adv=True)
    cfg = dict(tau_pos=1.0, tau_neg=1.05)
    loss, grad, _ = loss_and_grad("sapo", old, lp, adv, mask, "seq-mean-token-mean", cfg)
    r = torch.exp(lp - old)
    tau = torch.where(adv > 0, 1.0, 1.05)
    per_token = -(4 / tau) * torch.sigmoid(tau * (r - 1)) * adv
    want = ((per_token * mask).sum(-1) / mask.sum(-1)).mean()
    torch.testing.assert_close(loss, want)
    # on policy (r = 1) the gate's slope is 1: the plain policy gradient
    _, grad1, _ = loss_and_grad("sapo", lp.detach(), lp, adv, mask, "token-mean", cfg)
    torch.testing.assert_close(grad1, -adv * mask / mask.sum())
    with pytest.raises(ValueError, match="tau_pos"):
        get_policy_loss_fn("sapo")(old, lp, adv, mask, "token-mean", dict(tau_pos=0.0))


def test_dppo_masks_by_the_probability_gap_and_the_binary_kl():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5, 0.02, 0.9]]))
    p = torch.tensor([[0.7, 0.55, 0.3, 0.45, 0.2, 0.95]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0, -1.0]])
    mask = torch.ones(1, 6, dtype=torch.bool)
    lp = torch.log(p).requires_grad_(True)
    cfg = dict(clip_ratio=0.1, clip_ratio_c=20.0)
    # TV: A > 0 leaves when p - p_old > 0.1; A < 0 when p - p_old < -0.1
    _, grad, metrics = loss_and_grad("dppo_tv", old, lp, adv, mask, "token-sum", cfg)
    kept = torch.tensor([[0.0, 1, 0, 1, 0, 1]])
    ratio = (p / old.exp())
    torch.testing.assert_close(grad, -adv * ratio * kept)
    assert float(metrics["actor/pg_clipfrac"].value) == pytest.approx(3 / 6)
    # binary KL of each token's Bernoulli(p_old) -> Bernoulli(p), against 0.1
    q = old.exp()
    bkl = q * torch.log(q / p) + (1 - q) * torch.log((1 - q) / (1 - p))
    moved_up, moved_down = p > q, p < q
    kept_kl = torch.where(adv > 0, (bkl <= 0.1) | ~moved_up, (bkl <= 0.1) | ~moved_down).float()
    _, grad_kl, _ = loss_and_grad("dppo_kl", old, lp, adv, mask, "token-sum", cfg)
    torch.testing.assert_close(grad_kl, -adv * ratio * kept_kl, atol=1e-6, rtol=1e-5)
    # 0.5 -> 0.7 (or 0.3): d = 0.087, kept; 0.02 -> 0.2 with A > 0: d = 0.153, out
    assert kept_kl.tolist() == [[1.0, 1.0, 1.0, 1.0, 0.0, 1.0]]


# --------------------------------------------------------------------------- TRL 1.16 as the reference


def trl_loss(loss_type: str, level: str, old, lp, adv, mask, **args) -> torch.Tensor:
    """TRL's ``GRPOTrainer._compute_loss`` on the given log-probs (its model forward replaced by them)."""
    grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    b, t = lp.shape
    ids = torch.zeros(b, t, dtype=torch.long)
    args = SimpleNamespace(delta=None, use_bias_correction_kl=False, **args)
    trainer = SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level, beta=0.0,
        loss_type=loss_type, epsilon_low=args.epsilon_low, epsilon_high=args.epsilon_high, args=args,
        use_vllm=False, model=SimpleNamespace(training=False), aux_loss_enabled=False,
        _entropy_bonus_enabled=False, use_adaptive_entropy=False, current_gradient_accumulation_steps=1,
        _metrics={"eval": defaultdict(list), "train": defaultdict(list)},
        accelerator=SimpleNamespace(num_processes=1, gather=lambda x: x, gather_for_metrics=lambda x: x,
                                    reduce=lambda x, reduction="sum": x, sync_gradients=True),
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, torch.zeros_like(lp), None),
    )
    inputs = {"prompt_ids": ids[:, :1], "prompt_mask": torch.ones(b, 1, dtype=torch.long),
              "completion_ids": ids, "completion_mask": mask.long(), "advantages": adv[:, 0],
              "old_per_token_logps": old, "num_items_in_batch": mask.sum().float()}
    try:
        return grpo.GRPOTrainer._compute_loss(trainer, None, inputs)
    except (AttributeError, KeyError) as err:  # a TRL whose loss reads more of the trainer
        pytest.skip(f"TRL's _compute_loss needs more than this harness gives: {err!r}")


@pytest.mark.parametrize("name, trl_args", [
    ("gspo", ("grpo", "sequence", dict(epsilon_low=0.05, epsilon_high=0.08))),
    ("sapo", ("sapo", "token", dict(epsilon_low=0.2, epsilon_high=0.2, sapo_temperature_pos=1.0,
                                    sapo_temperature_neg=1.05))),
    ("cispo", ("cispo", "token", dict(epsilon_low=0.2, epsilon_high=1.1))),
])
def test_agrees_with_trl(name, trl_args):
    loss_type, level, args = trl_args
    old, lp, adv, mask = inputs(3)
    ours = {"gspo": (dict(clip_ratio_low=0.05, clip_ratio_high=0.08), "seq-mean-token-mean"),
            "sapo": (dict(tau_pos=1.0, tau_neg=1.05), "seq-mean-token-mean"),
            "cispo": (dict(clip_ratio_low=1.0, clip_ratio_high=0.1), "token-mean")}[name]
    loss, grad, _ = loss_and_grad(name, old, lp, adv, mask, ours[1], ours[0])
    reference = trl_loss(loss_type, level, old, lp, adv, mask, **args)
    (ref_grad,) = torch.autograd.grad(reference, lp)
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- rules and denominators


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "geo_mean", "gmpo"])
@pytest.mark.parametrize("mode", [m for m in MODES if m != "seq-mean-token-mean"])
def test_sequence_ratio_losses_refuse_length_weighting_modes(name, mode):
    with pytest.raises(ValueError) as err:
        PPOLossConfig(policy_loss=name, loss_agg_mode=mode, loss_scale_factor=8.0)
    text = str(err.value)
    assert repr(name) in text and repr(mode) in text and "loss_agg_mode='seq-mean-token-mean'" in text
    PPOLossConfig(policy_loss=name, loss_agg_mode="seq-mean-token-mean")


@pytest.mark.parametrize("name", ["cispo", "sapo", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov"])
@pytest.mark.parametrize("mode", MODES)
def test_token_level_losses_take_every_mode(name, mode):
    PPOLossConfig(policy_loss=name, loss_agg_mode=mode, loss_scale_factor=8.0)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(tau_neg=0.0), "tau_neg"), (dict(clip_cov_ratio=0.0), "clip_cov_ratio"),
    (dict(kl_cov_ratio=1.5), "kl_cov_ratio"), (dict(clip_cov_lb=5.0), "clip_cov_lb"),
    (dict(ppo_kl_coef=-1.0), "ppo_kl_coef"),
])
def test_loss_parameters_are_checked_when_the_config_is_built(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        PPOLossConfig(**kwargs)


@pytest.mark.parametrize("name", ["gspo_token", "cispo", "sapo", "dppo_tv", "dppo_kl"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_new_losses_use_global_denominators(name, mode):
    """dp=2 x 2 micro-batches each equals the one-shot loss (no local mean anywhere)."""
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(8, 6, generator=g) - 0.05
    lp = old + 0.3 * torch.randn(8, 6, generator=g)
    adv = torch.randn(8, 6, generator=g)
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
    assert math.isfinite(total)


def test_gpg_policy_loss_is_unchanged():
    old, lp, adv, mask = inputs()
    loss, _ = get_policy_loss_fn("gpg")(old, lp, adv, mask, "token-mean", {})
    torch.testing.assert_close(loss, agg_loss(-lp * adv, mask, "token-mean"))
