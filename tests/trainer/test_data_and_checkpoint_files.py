"""Data sharding and resume positions; which checkpoint directories count as complete."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from verl_trainer.data.sharded_loader import ResumableDistributedSampler, ShardedLoader, as_dataloader
from verl_trainer.engine.checkpoint_dirs import (
    STATE_FILE,
    find_last_checkpoint,
    list_checkpoints,
    prune_checkpoints,
)
from verl_trainer.utils.fs import mark_owned


def _shards(n: int, dp: int, epoch: int = 0, start: int = 0, shuffle: bool = True) -> list[list[int]]:
    out = []
    for rank in range(dp):
        s = ResumableDistributedSampler(n, dp, rank, shuffle=shuffle, seed=5)
        s.set_epoch(epoch)
        s.set_start(start)
        out.append(list(s))
    return out


def test_shards_are_disjoint_complete_and_seeded():
    shards = _shards(10, 2)
    assert sorted(shards[0] + shards[1]) == list(range(10))
    assert shards == _shards(10, 2)  # deterministic
    assert shards != _shards(10, 2, epoch=1)  # a new permutation per epoch
    padded = _shards(7, 2)  # padded by repeating, equal length on every rank
    assert len(padded[0]) == len(padded[1]) == 4 and set(padded[0] + padded[1]) == set(range(7))
    assert _shards(6, 3, shuffle=False) == [[0, 3], [1, 4], [2, 5]]


def test_resume_skips_globally_consumed_samples_also_with_another_dp_size():
    order = ResumableDistributedSampler(12, 2, 0, shuffle=True, seed=5).global_order().tolist()
    # dp=2 consumed 4 samples (2 batches of 1 per rank); the rest, read by dp=2 or dp=4, is the same set
    rest2, rest4 = _shards(12, 2, start=4), _shards(12, 4, start=4)
    assert sorted(sum(rest2, [])) == sorted(order[4:]) == sorted(sum(rest4, []))
    assert rest2[0] == order[4::2]
    with pytest.raises(ValueError, match="not a multiple of the data-parallel size"):
        _shards(12, 4, start=6)


def test_sharded_loader_position_round_trip():
    data = list(range(20))
    loader = DataLoader(data, batch_size=2, shuffle=True)
    full = ShardedLoader(loader, dp_rank=1, dp_size=2, seed=3)
    it = full.epoch_batches()
    first = [next(it).tolist() for _ in range(2)]
    full.advance(), full.advance()
    state = full.state_dict()
    assert state == {"epoch": 0, "samples": 8}
    expected = [b.tolist() for b in it]
    resumed = ShardedLoader(loader, dp_rank=1, dp_size=2, seed=3)
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed.epoch_batches()] == expected
    assert first and expected and not set(sum(first, [])) & set(sum(expected, []))


def test_peek_reads_the_next_batches_without_consuming_them():
    """The one-step-off rollout's read-ahead: the batches that come next, also past the epoch's end."""
    data = DataLoader(list(range(12)), batch_size=2, shuffle=True)
    loader = ShardedLoader(data, dp_rank=1, dp_size=2, seed=3)
    epoch0 = [b.tolist() for b in loader.epoch_batches()]  # 3 batches on this rank
    assert [b.tolist() for b in loader.peek(2)] == epoch0[:2]
    loader.advance(), loader.advance()
    assert [b.tolist() for b in loader.peek(2)] == epoch0[2:]  # the epoch's last batch only
    assert loader.state_dict() == {"epoch": 0, "samples": 8}  # peeking moved nothing
    loader.advance()
    ahead = [b.tolist() for b in loader.peek(1)]  # exhausted: the next epoch's first batch
    loader.next_epoch()
    assert ahead == [next(iter(loader.epoch_batches())).tolist()]


def test_unshardable_sources():
    with pytest.raises(TypeError, match="map-style"):
        as_dataloader(iter([1, 2]), "train data")

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield 1

    with pytest.raises(TypeError, match="IterableDataset"):
        ShardedLoader(DataLoader(Stream()), 0, 1, 0)


def _fake_checkpoint(root, name: str, complete: bool = True) -> None:
    d = root / name
    mark_owned(d, "checkpoint")
    if complete:
        (d / STATE_FILE).write_bytes(b"x")


def test_last_checkpoint_ignores_interrupted_writes(tmp_path):
    assert find_last_checkpoint(tmp_path / "missing") is None
    _fake_checkpoint(tmp_path, "step_000002")
    _fake_checkpoint(tmp_path, "step_000003")
    _fake_checkpoint(tmp_path, ".step_000004.tmp")  # interrupted mid-write (even with a state file)
    _fake_checkpoint(tmp_path, "step_000005", complete=False)  # no state file: not complete
    _fake_checkpoint(tmp_path, "unrelated")
    assert find_last_checkpoint(tmp_path) == tmp_path / "step_000003"
    _fake_checkpoint(tmp_path, ".step_000006.old")  # moved aside by a commit that was interrupted
    assert find_last_checkpoint(tmp_path) == tmp_path / ".step_000006.old"
    assert [step for step, _ in list_checkpoints(tmp_path)] == [2, 3, 6]


def test_prune_keeps_the_newest(tmp_path):
    for step in (1, 2, 3):
        _fake_checkpoint(tmp_path, f"step_{step:06d}")
    _fake_checkpoint(tmp_path, ".step_000002.tmp", complete=False)
    prune_checkpoints(tmp_path, keep=2, current_step=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000003"]
