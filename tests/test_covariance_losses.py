"""Clip-Cov / KL-Cov: the selection by hand, its independence of how the step is split over ranks (real gloo
ranks), and the loss through ``PPOLoss.prepare``."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from verl_trainer.core_algos.covariance_losses import (
    prepare_clip_cov,
    prepare_kl_cov,
    select_clip_cov,
    select_kl_cov,
    token_priority,
)
from verl_trainer.core_algos.losses import PPOLossConfig, ppo_loss
from verl_trainer.core_algos.policy_losses import PREPARED_KEY
from verl_trainer.testing.ranks import run_distributed


def step_batch(rows: int = 10, width: int = 12, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, width)
    for i in range(rows):
        mask[i, 2: 2 + int(torch.randint(1, width - 2, (1,), generator=g))] = 1.0
    mask[3] = 0.0  # a real sample with no trained token
    adv = (torch.randn(rows, 1, generator=g) * 2).expand(rows, width) * mask
    old = -torch.rand(rows, width, generator=g) * 3 * mask
    return TensorDict({
        "input_ids": torch.randint(3, 50, (rows, width), generator=g), "loss_mask": mask,
        "advantages": adv, "old_log_probs": old, "uid": torch.arange(rows) // 2,
    }, batch_size=[rows])


def test_kl_cov_picks_the_largest_covariances():
    b = step_batch()
    cfg = {"kl_cov_ratio": 0.1}
    prio = token_priority(b["old_log_probs"], b["input_ids"], b["uid"])
    sel = select_kl_cov(b["advantages"], b["old_log_probs"], b["loss_mask"], prio, cfg)
    valid = b["loss_mask"].bool()
    a, lp = b["advantages"].double()[valid], b["old_log_probs"].double()[valid]
    cov = (a - a.mean()) * (lp - lp.mean())
    k = max(1, int(cov.numel() * 0.1))
    want = torch.zeros_like(valid)
    want[valid] = cov >= torch.topk(cov, k).values[-1]
    assert sel.bool().equal(want) and int(sel.sum()) == k
    # all advantages equal: every covariance is 0, the priority alone picks exactly k tokens
    flat = select_kl_cov(torch.zeros_like(b["advantages"]), b["old_log_probs"], b["loss_mask"], prio, cfg)
    assert int(flat.sum()) == k
    assert prio[flat.bool()].max() < prio[valid & ~flat.bool()].min()


def test_clip_cov_picks_clip_num_tokens_of_the_band():
    b = step_batch()
    cfg = {"clip_cov_ratio": 0.05, "clip_cov_lb": 0.0, "clip_cov_ub": 5.0}
    prio = token_priority(b["old_log_probs"], b["input_ids"], b["uid"])
    sel = select_clip_cov(b["advantages"], b["old_log_probs"], b["loss_mask"], prio, cfg)
    valid = b["loss_mask"].bool()
    a, lp = b["advantages"].double(), b["old_log_probs"].double()
    cov = (a - a[valid].mean()) * (lp - lp[valid].mean())
    band = valid & (cov > 0.0) & (cov < 5.0)
    clip_num = max(1, int(int(valid.sum()) * 0.05))
    assert int(band.sum()) > clip_num  # the choice is a real one
    assert int(sel.sum()) == clip_num and bool((sel.bool() & ~band).sum() == 0)
    chosen = prio[sel.bool()]
    assert chosen.max() < prio[band & ~sel.bool()].min()  # the lowest priorities of the band


def _prepare_on_ranks(batch: TensorDict, splits: list[list[int]], cfg: dict) -> dict:
    import torch.distributed as dist

    rows = splits[dist.get_rank()]
    mine = batch[torch.tensor(rows)]
    if dist.get_rank() == 1:  # this rank's batch is padded wider (as a re-padded shard would be)
        mine = TensorDict({k: torch.cat([v, torch.zeros_like(v[:, :3])], dim=1) if v.ndim == 2 else v
                           for k, v in mine.items()}, batch_size=mine.batch_size)
    width = batch["loss_mask"].shape[1]
    return {"rows": rows, "kl": prepare_kl_cov(mine, cfg, dist.group.WORLD)[:, :width],
            "clip": prepare_clip_cov(mine, cfg, dist.group.WORLD)[:, :width]}


def test_selection_does_not_depend_on_the_split_over_ranks():
    """2 gloo ranks, an uneven shuffled split, padded to another width: the one-process selection."""
    b = step_batch(rows=14, seed=3)
    cfg = {"kl_cov_ratio": 0.08, "clip_cov_ratio": 0.04, "clip_cov_lb": 0.0, "clip_cov_ub": 10.0}
    one_kl, one_clip = prepare_kl_cov(b, cfg, None), prepare_clip_cov(b, cfg, None)
    assert one_kl.sum() > 1 and one_clip.sum() > 1
    splits = [[13, 0, 7, 2, 9], [1, 3, 4, 5, 6, 8, 10, 11, 12]]
    for result in run_distributed(_prepare_on_ranks, 2, b, splits, cfg, timeout=180):
        rows = torch.tensor(result["rows"])
        assert result["kl"].equal(one_kl[rows]) and result["clip"].equal(one_clip[rows])


def test_loss_reads_the_prepared_selection_and_refuses_without_it():
    b = step_batch()
    g = torch.Generator().manual_seed(1)
    lp = (b["old_log_probs"] + 0.2 * torch.randn(b["loss_mask"].shape, generator=g)).requires_grad_(True)
    for name, cfg in (("kl_cov", dict(kl_cov_ratio=0.1, ppo_kl_coef=2.0)),
                      ("clip_cov", dict(clip_cov_ratio=0.05, clip_cov_lb=0.0))):
        loss_fn = ppo_loss(PPOLossConfig(policy_loss=name, **cfg))
        assert loss_fn.needs_prepare
        with pytest.raises(KeyError, match="prepare"):
            loss_fn({"log_probs": lp}, b, None)
        prepared = loss_fn.prepare(b)
        sel = prepared[PREPARED_KEY]
        loss, metrics = loss_fn({"log_probs": lp}, prepared, None)
        mask = b["loss_mask"].bool()
        log_r = lp - b["old_log_probs"]
        r, adv = log_r.exp(), b["advantages"]
        if name == "kl_cov":
            per_token = -adv * r + sel * 2.0 * log_r.abs()
        else:
            per_token = torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2)) * (1 - sel)
        torch.testing.assert_close(loss, (per_token * mask).sum() / mask.sum())
        assert float(metrics["actor/pg_clipfrac"].value) == pytest.approx(float(sel.sum() / mask.sum()))
    assert not ppo_loss(PPOLossConfig()).needs_prepare
