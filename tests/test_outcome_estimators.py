"""OPO, GPG, pass@k (closed form and verl's grpo_passk), REINFORCE++-baseline: hand-computed values, GPG's
batch counts over gloo ranks, and the config refusals."""

from __future__ import annotations

import math

import pytest
import torch

from verl_trainer.algorithms.config import GRPOConfig
from verl_trainer.core_algos import get_adv_estimator_fn
from verl_trainer.core_algos.advantages import resolve_estimator
from verl_trainer.rollout.config import RolloutConfig
from verl_trainer.testing.ranks import run_distributed


def rewards(scores: list[float], lengths: list[int], width: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Outcome rewards on the last response token; ``[B, width]`` rewards and mask."""
    mask = torch.zeros(len(scores), width)
    rew = torch.zeros(len(scores), width)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        mask[i, 1: 1 + n] = 1.0
        rew[i, n] = s
    return rew, mask


def scalar(adv: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """The per-response advantage (checked constant over its tokens)."""
    out = []
    for row, m in zip(adv, mask.bool()):
        assert torch.allclose(row[m], row[m][0]) and bool((row[~m] == 0).all())
        out.append(float(row[m][0]))
    return out


def test_opo_subtracts_the_length_weighted_group_mean():
    rew, mask = rewards([1, 0, 1, 0.5, 2.0], [2, 4, 3, 5, 1])
    index = [0, 0, 0, 1, 7]
    adv, _ = get_adv_estimator_fn("opo")(rew, mask, index)
    b0 = (2 * 1 + 4 * 0 + 3 * 1) / 9
    assert scalar(adv, mask) == pytest.approx([1 - b0, -b0, 1 - b0, 0.5, 2.0])  # a group of one: baseline 0


def test_gpg_scales_the_centred_scores_by_batch_over_nonzero():
    rew, mask = rewards([1, 0, 0, 0, 1, 1], [2, 2, 3, 1, 2, 2])
    index = [0, 0, 1, 1, 2, 2]
    adv, _ = get_adv_estimator_fn("gpg")(rew, mask, index)
    alpha = 6 / 3
    assert scalar(adv, mask) == pytest.approx([alpha * 0.5, -alpha * 0.5, 0, 0, 0, 0])


def _gpg_on_ranks(rew, mask, index, rows):
    import torch.distributed as dist

    mine = rows[dist.get_rank()]
    return get_adv_estimator_fn("gpg")(rew[mine], mask[mine], [index[i] for i in mine],
                                       dp_group=dist.group.WORLD)[0]


def test_gpg_counts_the_whole_dp_batch():
    rew, mask = rewards([1, 0, 0, 0, 1, 1, 0, 0], [2, 2, 3, 1, 2, 2, 1, 4])
    index = [0, 0, 1, 1, 2, 2, 3, 3]
    whole, _ = get_adv_estimator_fn("gpg")(rew, mask, index)
    rows = [[0, 1, 6, 7], [2, 3, 4, 5]]  # rank 0 holds 1 non-zero of 4, rank 1 holds 2 of 4
    per_rank = run_distributed(_gpg_on_ranks, 2, rew, mask, index, rows, timeout=180)
    for mine, adv in zip(rows, per_rank):
        torch.testing.assert_close(adv, whole[mine])
    assert "dp_group" in __import__("inspect").signature(resolve_estimator("gpg").fn).parameters


def test_pass_at_k_closed_form():
    # a group of 4 with one correct answer, k = 2: R = 1 - C(3,2)/C(4,2) = 1/2, s = 1/2
    rew, mask = rewards([1, 0, 0, 0, 1, 1, 1, 1], [2] * 8)
    index = [0, 0, 0, 0, 1, 1, 1, 1]
    adv, _ = get_adv_estimator_fn("pass_at_k")(rew, mask, index, config={"pass_k": 2})
    neg = (1 - math.comb(2, 1) / math.comb(3, 1) - 0.5) / 0.5
    assert scalar(adv, mask) == pytest.approx([1.0, neg, neg, neg, 0, 0, 0, 0])  # all correct: 0
    # k = 1 is GRPO with the population std
    adv1, _ = get_adv_estimator_fn("pass_at_k")(rew, mask, index, config={"pass_k": 1})
    r = torch.tensor([1.0, 0, 0, 0])
    want = ((r - r.mean()) / r.std(unbiased=False)).tolist()
    assert scalar(adv1, mask)[:4] == pytest.approx(want)
    with pytest.raises(ValueError, match="binary"):
        get_adv_estimator_fn("pass_at_k")(rew * 0.5, mask, index, config={"pass_k": 2})
    with pytest.raises(ValueError, match="pass_k"):
        get_adv_estimator_fn("pass_at_k")(rew, mask, index, config={"pass_k": 5})


def test_grpo_passk_rewards_only_the_best_response():
    rew, mask = rewards([0.2, 0.9, 0.5, 1.0, 1.0], [2] * 5)
    adv, _ = get_adv_estimator_fn("grpo_passk")(rew, mask, [0, 0, 0, 1, 1], norm_adv_by_std_in_grpo=False)
    assert scalar(adv, mask) == pytest.approx([0, 0.9 - 0.5, 0, 0, 0])  # a tie: gap 0 (to the first)
    adv, _ = get_adv_estimator_fn("grpo_passk")(rew, mask, [0, 0, 0, 1, 1])
    std = torch.tensor([0.2, 0.9, 0.5]).std().item()
    assert scalar(adv, mask)[1] == pytest.approx(0.4 / (std + 1e-6))


def test_reinforce_plus_plus_baseline_centres_by_group_then_whitens():
    rew, mask = rewards([1, 0, 3, 1, 2.0], [2, 3, 1, 2, 2])
    index = [0, 0, 1, 1, 5]
    adv, returns = get_adv_estimator_fn("reinforce_plus_plus_baseline")(rew, mask, index)
    g = torch.tensor([0.5, -0.5, 1.0, -1.0, 2.0])
    assert scalar(returns, mask) == pytest.approx(g.tolist())
    tokens = torch.cat([g[i].repeat(n) for i, n in enumerate([2, 3, 1, 2, 2])])
    white = (g - tokens.mean()) / tokens.std()
    assert scalar(adv, mask) == pytest.approx(white.tolist(), rel=1e-5)
    assert resolve_estimator("reinforce_plus_plus_baseline").whitens == "returns"


def test_grpo_config_pass_k_rules():
    rollout = RolloutConfig(n=4)
    GRPOConfig(adv_estimator="pass_at_k", pass_k=4, rollout=rollout)
    with pytest.raises(ValueError, match="algorithm.pass_k"):
        GRPOConfig(adv_estimator="pass_at_k", rollout=rollout)
    with pytest.raises(ValueError, match=r"\[1, rollout.n=4\]"):
        GRPOConfig(adv_estimator="pass_at_k", pass_k=5, rollout=rollout)
    with pytest.raises(ValueError, match="read only by adv_estimator=pass_at_k"):
        GRPOConfig(adv_estimator="grpo", pass_k=2, rollout=rollout)
    for name in ("opo", "gpg", "grpo_passk", "reinforce_plus_plus_baseline"):
        GRPOConfig(adv_estimator=name, rollout=rollout)
