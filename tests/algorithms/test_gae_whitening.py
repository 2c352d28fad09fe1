"""PPO's GAE advantages are whitened over the global batch: the same for dp=1 and dp=2."""

import torch
import torch.distributed as dist

from verl_trainer.algorithms.ppo import compute_gae_advantages
from verl_trainer.algorithms.stages.signal import global_masked_whiten
from verl_trainer.algorithms.stages.update import count_mini_batches, split_mini_batches
from verl_trainer.core_algos import compute_gae_advantage_return, masked_whiten
from verl_trainer.data.packing import make_batch
from verl_trainer.testing.ranks import run_distributed


def _step_batch(seed: int = 0, b: int = 8, t: int = 12) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, 5, (b,), generator=g)
    resp = torch.randint(1, t - 4, (b,), generator=g)
    pos = torch.arange(t)
    mask = ((pos >= prompt[:, None]) & (pos < (prompt + resp)[:, None])).float()
    last = (prompt + resp - 1).long()
    rewards = torch.zeros(b, t)
    rewards[torch.arange(b), last] = torch.randn(b, generator=g)
    values = torch.randn(b, t, generator=g) * mask
    return rewards, values, mask


def _whiten_worker(gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    rewards, values, mask = _step_batch()
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = torch.arange(rewards.shape[0]).tensor_split(world)[rank]
    return compute_gae_advantages(rewards[rows], values[rows], mask[rows], gamma, lam, group=None)


def test_gae_whitening_is_dp_invariant():
    gamma, lam = 0.99, 0.95
    rewards, values, mask = _step_batch()
    adv1, ret1 = compute_gae_advantages(rewards, values, mask, gamma, lam)
    # dp=1 equals the registry's gae (verl's recursion + whitening of the whole batch)
    ref_adv, ref_ret = compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv1, ref_adv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret1, ref_ret)
    # dp=2: each rank holds half of the batch; the concatenation equals dp=1
    parts = run_distributed(_whiten_worker, 2, gamma, lam, timeout=120)
    adv2 = torch.cat([p[0] for p in parts])
    ret2 = torch.cat([p[1] for p in parts])
    torch.testing.assert_close(adv2, adv1, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ret2, ret1)


def test_global_masked_whiten_matches_masked_whiten_on_one_rank():
    _, values, mask = _step_batch(seed=3)
    torch.testing.assert_close(global_masked_whiten(values, mask) * mask, masked_whiten(values, mask) * mask,
                               atol=1e-5, rtol=1e-5)


def _split_worker() -> list[int]:
    rank = dist.get_rank()
    count = 5 if rank == 0 else 1  # uneven: rank 1 is short of samples
    batch = make_batch([[4, 5]] * count, [[6, 7]] * count)
    return [mb.batch_size[0] for mb in split_mini_batches(batch, count_mini_batches(batch, 2, None))]


def test_split_mini_batches_same_count_on_every_rank():
    sizes0, sizes1 = run_distributed(_split_worker, 2, timeout=120)
    assert len(sizes0) == len(sizes1) == 3  # ceil(6 real samples / 2 per mini-batch)
    assert sum(sizes0) == 5 and sum(sizes1) == 3  # rank 1 got 2 padding samples
    assert min(sizes0 + sizes1) >= 1
