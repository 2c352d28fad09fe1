import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_trainer.core_algos.balancing import exchange_samples
from verl_trainer.testing import run_distributed


def _rank_batch(rank: int, n: int) -> TensorDict:
    g = torch.Generator().manual_seed(rank)
    lens = torch.randint(1, 9, (n,), generator=g)
    width = (int(lens.max()) if n else 0) + rank  # ranks pad to different widths
    valid = torch.arange(width) < lens[:, None]
    ids = torch.randint(1, 100, (n, width), generator=g) * valid
    return TensorDict(
        {
            "input_ids": ids,
            "attention_mask": valid.long(),
            "loss_mask": (torch.rand(n, width, generator=g) > 0.5) & valid,
            "advantages": torch.randn(n, width, generator=g) * valid,
            "uid": torch.arange(n) + 100 * rank,
            "seq_len": lens,
            "is_padding": torch.zeros(n, dtype=torch.bool),
        },
        batch_size=[n],
    )


def _exchange(sizes):
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = _rank_batch(rank, sizes[rank])
    dest = (torch.arange(sizes[rank]) * 7 + rank) % world
    got = exchange_samples(batch, dest)
    # Expected: every rank's batch rebuilt locally, filtered to dest == rank, in (src, idx) order.
    expected = []
    for src in range(world):
        b = _rank_batch(src, sizes[src])
        d = (torch.arange(sizes[src]) * 7 + src) % world
        expected.extend(b[i] for i in range(sizes[src]) if d[i] == rank)
    assert got.batch_size[0] == len(expected)
    for i, want in enumerate(expected):
        n = int(want["seq_len"])
        for key in ("input_ids", "attention_mask", "loss_mask", "advantages"):
            assert torch.equal(got[key][i, :n], want[key][:n]), key
            assert not got[key][i, n:].any(), key
            assert got[key].dtype == want[key].dtype
        for key in ("uid", "seq_len", "is_padding"):
            assert torch.equal(got[key][i], want[key])
    return got.batch_size[0]


def test_exchange_two_ranks_uneven():
    counts = run_distributed(_exchange, 2, [5, 3])
    assert sum(counts) == 8


def test_exchange_four_ranks_with_an_empty_rank():
    counts = run_distributed(_exchange, 4, [6, 0, 3, 9])
    assert sum(counts) == 18
