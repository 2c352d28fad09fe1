"""DAPO pieces: overlong shaping, equal-reward groups, and dynamic sampling keeping DP ranks in step."""

import torch
import torch.distributed as dist

from verl_trainer.algorithms.dapo import dynamic_sampling_filter, overlong_penalty, uniform_groups
from verl_trainer.algorithms.stages.update import count_mini_batches, split_mini_batches
from verl_trainer.data import schema
from verl_trainer.data.packing import make_batch
from verl_trainer.metrics import reduce_metrics
from verl_trainer.testing.ranks import run_distributed


def test_overlong_penalty_is_dapos_linear_buffer():
    lens = torch.tensor([0, 4, 6, 7, 8])
    pen = overlong_penalty(lens, max_len=8, buffer_len=4, penalty_factor=2.0)
    # zero up to max_len - buffer_len = 4 tokens, then linear down to -factor at max_len
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -1.0, -1.5, -2.0]))


def test_uniform_groups_marks_groups_with_equal_rewards():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.1, 0.1])
    uids = torch.tensor([5, 5, 7, 7, 9, 9])
    assert uniform_groups(scores, uids).tolist() == [True, True, False, False, True, True]


def _rank_batch(rank: int, groups: int, n: int, rewards: list[float]) -> tuple:
    prompts = [[4 + rank, 5 + g] for g in range(groups) for _ in range(n)]
    responses = [[6 + (i % 3)] * (1 + i % 3) for i in range(groups * n)]
    uids = torch.arange(groups).repeat_interleave(n) + rank * groups
    return make_batch(prompts, responses, uids=uids), torch.tensor(rewards)


def _dynamic_sampling_worker(case: str) -> dict:
    rank = dist.get_rank()
    n = 2
    if case == "one_rank_empty":
        # rank 0: every group uniform (all dropped); rank 1: 3 groups, one with signal
        rewards = [1.0, 1.0, 0.0, 0.0] if rank == 0 else [1.0, 0.0, 0.1, 0.1, 0.0, 0.0]
    else:  # every group on every rank uniform
        rewards = [1.0, 1.0, 0.0, 0.0] if rank == 0 else [0.1, 0.1, 0.0, 0.0, 1.0, 1.0]
    batch, scores = _rank_batch(rank, len(rewards) // n, n, rewards)
    kept, any_left, metrics = dynamic_sampling_filter(batch, scores, None, dp_size=2)
    minis = split_mini_batches(kept, count_mini_batches(kept, 1, None))
    # a collective per mini-batch, as an engine step would run: a rank with a different count hangs here
    for mb in minis:
        dist.all_reduce(mb[schema.LOSS_MASK].sum().reshape(1))
    reduced = reduce_metrics([metrics])
    return {
        "rows": kept.batch_size[0],
        "real": int((~kept[schema.IS_PADDING]).sum()),
        "padding_loss_tokens": float(kept[schema.LOSS_MASK][kept[schema.IS_PADDING]].sum()),
        "any_left": any_left,
        "num_minis": len(minis),
        "mini_sizes": [mb.batch_size[0] for mb in minis],
        "metrics": reduced,
    }


def test_dynamic_sampling_keeps_ranks_in_step_when_one_rank_keeps_nothing():
    r0, r1 = run_distributed(_dynamic_sampling_worker, 2, "one_rank_empty", timeout=120)
    assert r0["real"] == 0 and r0["rows"] == 1 and r0["padding_loss_tokens"] == 0.0
    assert r1["real"] == 2
    assert r0["any_left"] and r1["any_left"]
    # the same number of non-empty mini-batches on both ranks (2 real samples, 1 per mini-batch)
    assert r0["num_minis"] == r1["num_minis"] == 2
    assert min(r0["mini_sizes"] + r1["mini_sizes"]) >= 1
    assert r0["metrics"] == r1["metrics"]
    assert r0["metrics"]["dapo/kept_samples"] == 2.0
    assert abs(r0["metrics"]["dapo/kept_group_frac"] - 1 / 5) < 1e-9


def test_dynamic_sampling_all_dropped_skips_the_update_on_every_rank():
    r0, r1 = run_distributed(_dynamic_sampling_worker, 2, "all_uniform", timeout=120)
    assert not r0["any_left"] and not r1["any_left"]
    assert r0["real"] == r1["real"] == 0
