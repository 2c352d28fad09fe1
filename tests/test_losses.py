"""Loss functions handed to the engine: config validation, composition, and the invariance of the
loss and its gradient to micro-batching and dp size (padding samples present)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from tensordict import TensorDict

from verl_trainer.core_algos import RolloutCorrectionConfig, agg_loss, kl_penalty
from verl_trainer.core_algos.aggregation import GlobalBatchInfo
from verl_trainer.core_algos.losses import (
    PPOLossConfig,
    SFTLossConfig,
    ValueLossConfig,
    ppo_loss,
    sft_loss,
    value_loss,
)
from verl_trainer.metrics import reduce_metrics

# --------------------------------------------------------------------------- shared batch helpers


def make_batch(batch_size: int = 8, width: int = 10, padding: tuple[int, ...] = (6, 7), seed: int = 0):
    """A padded RL batch ``[B, T]`` (prompt + response aligned with input_ids) and a model output.

    Rows in ``padding`` are synthetic padding samples (all-zero loss_mask, ``is_padding``). Returns
    ``(data, model_output)``; the model output tensors are leaves that require grad.
    """
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(batch_size, width, dtype=torch.bool)
    attn = torch.zeros(batch_size, width, dtype=torch.long)
    for i in range(batch_size):
        prompt = int(torch.randint(1, 4, (1,), generator=g))
        resp = int(torch.randint(1, width - prompt + 1, (1,), generator=g))
        attn[i, : prompt + resp] = 1
        if i not in padding:
            mask[i, prompt : prompt + resp] = True
    is_padding = torch.zeros(batch_size, dtype=torch.bool)
    is_padding[list(padding)] = True

    def rand(scale: float = 1.0) -> torch.Tensor:
        return torch.randn(batch_size, width, generator=g) * scale * attn

    old = -torch.rand(batch_size, width, generator=g) * 2 * attn
    adv = (torch.randn(batch_size, 1, generator=g) * mask).float()
    data = TensorDict(
        {
            "loss_mask": mask,
            "attention_mask": attn,
            "old_log_probs": old,
            "ref_log_prob": old + rand(0.3),
            "advantages": adv,
            "values": rand(),
            "returns": rand(),
            "is_padding": is_padding,
        },
        batch_size=[batch_size],
    )
    out = {
        "log_probs": (old + rand(0.4)).requires_grad_(True),
        "entropy": (torch.rand(batch_size, width, generator=g) * 3 * attn).requires_grad_(True),
        "values": rand().requires_grad_(True),
    }
    data["rollout_log_probs"] = old + rand(0.6)  # the sampler's log-probs: mismatch metrics, TIS / MIS
    return data, out


def one_shot_info(data) -> GlobalBatchInfo:
    return GlobalBatchInfo(
        dp_size=1,
        batch_num_tokens=int(data["loss_mask"].sum()),
        global_batch_size=int((~data["is_padding"]).sum()),
    )


# rank -> micro-batches (lists of sample indices); rank 1 has a padding-only micro-batch
SPLIT_DP2 = [[[0, 1, 2], [3]], [[4], [5, 7], [6]]]
SPLIT_DP1 = [[[5], [0, 6, 2], [1, 3, 4, 7]]]


def run_split(loss_fn: Callable, data, out: dict, split: list[list[list[int]]]):
    """Run ``loss_fn`` per micro-batch of each rank with the global info of the split.

    Returns ``(per_rank_loss_sums, per_rank_metric_lists)``.
    """
    dp = len(split)
    info = GlobalBatchInfo(dp_size=dp, **{k: v for k, v in vars(one_shot_info(data)).items()
                                         if k in ("batch_num_tokens", "global_batch_size")})
    losses, metrics = [], []
    for rank, micro_batches in enumerate(split):
        rank_info = GlobalBatchInfo(info.dp_size, info.batch_num_tokens, info.global_batch_size, rank)
        total, rank_metrics = 0.0, []
        for idx in micro_batches:
            idx_t = torch.tensor(idx)
            loss, mets = loss_fn({k: v[idx_t] for k, v in out.items()}, data[idx_t], rank_info)
            total = total + loss
            rank_metrics.append(mets)
        losses.append(total)
        metrics.append(rank_metrics)
    return losses, metrics


LOSS_CASES = {
    "ppo_vanilla_token_mean": lambda: ppo_loss(PPOLossConfig(entropy_coeff=0.01, use_kl_loss=True,
                                                              kl_loss_type="k3+", clip_ratio_high=0.28)),
    "ppo_seq_mean_token_mean": lambda: ppo_loss(PPOLossConfig(loss_agg_mode="seq-mean-token-mean",
                                                               use_kl_loss=True, kl_loss_type="k1")),
    "dr_grpo": lambda: ppo_loss(PPOLossConfig(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=7.0,
                                              use_kl_loss=True, kl_loss_coef=0.1)),
    "gspo": lambda: ppo_loss(PPOLossConfig(policy_loss="gspo", clip_ratio_low=3e-4, clip_ratio_high=4e-4,
                                           loss_agg_mode="seq-mean-token-mean")),
    "gpg_token_sum": lambda: ppo_loss(PPOLossConfig(policy_loss="gpg", loss_agg_mode="token-sum")),
    "geo_mean": lambda: ppo_loss(PPOLossConfig(policy_loss="geo_mean", clip_ratio=0.4,
                                               loss_agg_mode="seq-mean-token-mean")),
    "ppo_tis_token": lambda: ppo_loss(PPOLossConfig(use_kl_loss=True),
                                      RolloutCorrectionConfig(level="token", threshold=1.5)),
    "ppo_mis_sequence": lambda: ppo_loss(PPOLossConfig(loss_agg_mode="seq-mean-token-mean"),
                                         RolloutCorrectionConfig(level="sequence_mask", threshold=3.0)),
    "value": lambda: value_loss(ValueLossConfig(cliprange_value=0.2)),
    "value_seq_mean": lambda: value_loss(ValueLossConfig(loss_agg_mode="seq-mean-token-sum")),
    "sft": lambda: sft_loss(),
}

# --------------------------------------------------------------------------- config validation


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(loss_agg_mode="token_mean"), "token-mean"),
        (dict(policy_loss="nope"), "'vanilla'"),
        (dict(clip_ratio_c=1.0), "clip_ratio_c"),
        (dict(clip_ratio=0.0), "clip_ratio"),
        (dict(clip_ratio_low=-0.1), "clip_ratio_low"),
        (dict(kl_loss_type="k4"), "low_var_kl"),
        (dict(loss_agg_mode="seq-mean-token-sum-norm"), "loss_scale_factor"),
        (dict(loss_scale_factor=0), "loss_scale_factor"),
    ],
)
def test_ppo_config_errors_name_value_and_choices(kwargs, needle):
    with pytest.raises(ValueError) as err:
        PPOLossConfig(**kwargs)
    assert needle in str(err.value)
    assert "PPOLossConfig" in str(err.value)


def test_dr_grpo_config_error_says_how_to_fix():
    with pytest.raises(ValueError, match="maximum response length"):
        PPOLossConfig(loss_agg_mode="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="loss_scale_factor"):
        ValueLossConfig(loss_agg_mode="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="loss_scale_factor"):
        SFTLossConfig(loss_agg_mode="seq-mean-token-sum-norm")
    cfg = PPOLossConfig(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=512)
    assert cfg.loss_scale_factor == 512


def test_value_config_errors():
    with pytest.raises(ValueError, match="cliprange_value"):
        ValueLossConfig(cliprange_value=-1)
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        SFTLossConfig(loss_agg_mode="mean")


def test_missing_inputs_are_clear_errors():
    data, out = make_batch()
    with pytest.raises(KeyError, match="entropy"):
        ppo_loss(PPOLossConfig(entropy_coeff=0.1))({"log_probs": out["log_probs"]}, data, one_shot_info(data))
    with pytest.raises(KeyError, match="ref_log_prob"):
        ppo_loss(PPOLossConfig(use_kl_loss=True))(out, data.exclude("ref_log_prob"), one_shot_info(data))
    with pytest.raises(ValueError, match="shape"):
        sft_loss()({"log_probs": out["log_probs"][:, :3]}, data, one_shot_info(data))


# --------------------------------------------------------------------------- composition


def test_ppo_loss_composes_policy_entropy_and_kl():
    data, out = make_batch()
    cfg = PPOLossConfig(entropy_coeff=0.02, use_kl_loss=True, kl_loss_coef=0.3, kl_loss_type="mse")
    info = one_shot_info(data)
    loss, metrics = ppo_loss(cfg)(out, data, info)
    plain, _ = ppo_loss(PPOLossConfig())(out, data, info)
    mask = data["loss_mask"]
    n = mask.sum()
    ent = (out["entropy"] * mask).sum().detach() / n
    kl = (0.5 * (out["log_probs"] - data["ref_log_prob"]) ** 2 * mask).sum().detach() / n
    torch.testing.assert_close(loss, plain - 0.02 * ent + 0.3 * kl)
    reduced = {k: v for k, v in reduce_metrics([metrics]).items()
               if not k.startswith(("rollout_corr/", "training/rollout_"))}  # the batch has rollout log-probs
    assert set(reduced) == {"actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower",
                            "actor/entropy_loss", "actor/entropy", "actor/kl_loss", "actor/kl_coef"}
    assert reduced["actor/kl_coef"] == pytest.approx(0.3)
    assert reduced["actor/entropy"] == pytest.approx(float(ent), rel=1e-6)
    assert reduced["actor/kl_loss"] == pytest.approx(float(kl), rel=1e-6)


def test_sft_loss_is_token_mean_nll_and_value_loss_matches_formula():
    data, out = make_batch()
    info = one_shot_info(data)
    mask = data["loss_mask"]
    loss, _ = sft_loss()(out, data, info)
    torch.testing.assert_close(loss, -(out["log_probs"] * mask).sum() / mask.sum())
    vloss, vmetrics = value_loss(ValueLossConfig(cliprange_value=0.2))(out, data, info)
    v, old, ret = out["values"], data["values"], data["returns"]
    clipped = old + (v - old).clamp(-0.2, 0.2)
    per_tok = torch.maximum((v - ret) ** 2, (clipped - ret) ** 2)
    torch.testing.assert_close(vloss, 0.5 * (per_tok * mask).sum() / mask.sum())
    assert 0 <= reduce_metrics([vmetrics])["critic/vf_clipfrac"] <= 1


def test_local_fallback_without_info_equals_one_shot_info():
    data, out = make_batch()
    for name, build in LOSS_CASES.items():
        fn = build()
        torch.testing.assert_close(fn(out, data, None)[0], fn(out, data, one_shot_info(data))[0], msg=name)


# --------------------------------------------------------------------------- invariance


@pytest.mark.parametrize("case", sorted(LOSS_CASES))
@pytest.mark.parametrize("split", [SPLIT_DP1, SPLIT_DP2], ids=["dp1_3mb", "dp2_uneven_mb"])
def test_loss_and_gradient_invariant_to_micro_batches_and_dp(case, split):
    data, out = make_batch()
    fn = LOSS_CASES[case]()
    ref_loss, ref_metrics = fn(out, data, one_shot_info(data))
    ref_grads = torch.autograd.grad(ref_loss, list(out.values()), allow_unused=True)

    rank_losses, rank_metrics = run_split(fn, data, out, split)
    dp = len(split)
    # DDP/FSDP average the gradients over dp ranks; the logged loss is the mean over ranks of the sums.
    total = sum(rank_losses) / dp
    torch.testing.assert_close(total, ref_loss, atol=1e-6, rtol=1e-6)
    grads = torch.autograd.grad(total, list(out.values()), allow_unused=True)
    for g, rg in zip(grads, ref_grads):
        if rg is None:
            assert g is None or torch.count_nonzero(g) == 0
        else:
            torch.testing.assert_close(g, rg, atol=1e-6, rtol=1e-6)

    if dp == 1:  # metric reduction over micro-batches (over ranks: tests/test_metrics.py, real gloo)
        got = reduce_metrics(rank_metrics[0])
        want = reduce_metrics([ref_metrics])
        assert got.keys() == want.keys()
        for k in want:
            assert math.isclose(got[k], want[k], rel_tol=1e-6, abs_tol=1e-6), (k, got[k], want[k])


def test_entropy_bonus_gradient_and_kl_straight_through_in_loss():
    data, out = make_batch()
    info = one_shot_info(data)
    mask = data["loss_mask"]
    cfg = PPOLossConfig(entropy_coeff=0.5)
    loss, _ = ppo_loss(cfg)(out, data, info)
    (g_ent,) = torch.autograd.grad(loss, [out["entropy"]])
    torch.testing.assert_close(g_ent, -0.5 * mask.float() / mask.sum())
    # k3+ in the loss: value of k3, gradient of k2
    kl_cfg = PPOLossConfig(use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type="k3+")
    with_kl, _ = ppo_loss(kl_cfg)(out, data, info)
    base, _ = ppo_loss(PPOLossConfig())(out, data, info)
    k3 = agg_loss(kl_penalty(out["log_probs"], data["ref_log_prob"], "k3"), mask, "token-mean")
    torch.testing.assert_close(with_kl - base, k3)
    (g,) = torch.autograd.grad(with_kl - base, [out["log_probs"]])
    torch.testing.assert_close(g, (out["log_probs"] - data["ref_log_prob"]).detach() * mask / mask.sum())


def test_no_info_uses_the_engine_definition_of_the_denominators():
    """A real sample with an all-zero loss mask counts in global_batch_size, with or without info."""
    from verl_trainer.core_algos.aggregation import GlobalBatchInfo
    from verl_trainer.core_algos.losses import SFTLossConfig, sft_loss

    g = torch.Generator().manual_seed(0)
    mask = torch.ones(4, 6)
    mask[1] = 0  # a real sample that trains nothing
    data = {"loss_mask": mask, "is_padding": torch.tensor([False, False, False, True])}
    data["loss_mask"][3] = 0
    out = {"log_probs": -torch.rand(4, 6, generator=g)}
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum", "token-mean"):
        fn = sft_loss(SFTLossConfig(loss_agg_mode=mode))
        info = GlobalBatchInfo(dp_size=1, batch_num_tokens=12, global_batch_size=3)
        assert GlobalBatchInfo.from_batch(data) == info
        torch.testing.assert_close(fn(out, data, None)[0], fn(out, data, info)[0])
