import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_trainer.balancing import calculate_workload
from verl_trainer.callbacks.sequence_balancing import SequenceBalancing, balance_batch
from verl_trainer.testing import run_distributed


def _rank_batch(rank: int, n: int, lo: int, hi: int, width_cap: int | None = None) -> TensorDict:
    g = torch.Generator().manual_seed(1000 + rank)
    lens = torch.randint(lo, hi + 1, (n,), generator=g)
    width = int(lens.max()) if n else 1
    valid = torch.arange(width) < lens[:, None]
    ids = (torch.arange(width) + 7 * rank + 1)[None, :].repeat(n, 1) % 97 * valid
    loss = valid.float()
    loss[:, : min(3, width)] = 0
    return TensorDict(
        {
            "input_ids": ids,
            "attention_mask": valid.long(),
            "position_ids": torch.arange(width)[None, :].repeat(n, 1) * valid,
            "loss_mask": loss,
            "advantages": torch.randn(n, width, generator=g) * valid,
            "uid": torch.arange(n) // 2 + 1000 * rank,  # groups of 2
            "seq_len": lens,
            "is_padding": torch.zeros(n, dtype=torch.bool),
        },
        batch_size=[n],
    )


def _balance(sizes, ranges, batch_multiple):
    rank = dist.get_rank()
    lo, hi = ranges[rank]
    batch = _rank_batch(rank, sizes[rank], lo, hi)
    new, metrics = balance_batch(batch, None, hidden_size=4096, batch_multiple=batch_multiple)
    real = ~new["is_padding"]
    work = calculate_workload(new["seq_len"], hidden_size=4096).sum().item()
    # every real sample's data, keyed by (uid, first advantages), for a global check
    rows = [
        (int(new["uid"][i]), int(new["seq_len"][i]), float(new["advantages"][i].sum()),
         int(new["input_ids"][i].sum()), float(new["loss_mask"][i].sum()))
        for i in range(new.batch_size[0]) if real[i]
    ]
    pads = new[~real]
    pad_ok = bool((pads["loss_mask"].sum() == 0) and (pads["seq_len"] == 1).all())
    return new.batch_size[0], work, rows, metrics, [int(u) for u in pads["uid"]], pad_ok


def _expected_rows(sizes, ranges):
    rows = []
    for r, n in enumerate(sizes):
        b = _rank_batch(r, n, *ranges[r])
        rows += [(int(b["uid"][i]), int(b["seq_len"][i]), float(b["advantages"][i].sum()),
                  int(b["input_ids"][i].sum()), float(b["loss_mask"][i].sum())) for i in range(n)]
    return sorted(rows)


def _check(results, sizes, ranges, multiple):
    counts = [r[0] for r in results]
    assert len(set(counts)) == 1, counts  # equal_size
    total = sum(counts)
    assert total % multiple == 0 and total >= sum(sizes)
    got = sorted(row for r in results for row in r[2])
    assert got == _expected_rows(sizes, ranges)  # every real sample exactly once, data intact
    pad_uids = [u for r in results for u in r[4]]
    real_uids = {row[0] for row in got}
    assert len(pad_uids) == total - sum(sizes) and len(set(pad_uids)) == len(pad_uids)
    assert not set(pad_uids) & real_uids and all(r[5] for r in results)
    assert all(r[3] == results[0][3] for r in results)  # same metrics on every rank
    return [r[1] for r in results]


def test_two_ranks_very_different_lengths_balance_to_1e_3():
    sizes, ranges = [128, 128], [(50, 400), (2000, 4000)]
    results = run_distributed(_balance, 2, sizes, ranges, 1)
    work = _check(results, sizes, ranges, 2)
    assert max(work) / min(work) <= 1.001, work


def test_four_ranks_256_uniform_samples_and_padding():
    sizes, ranges = [100, 60, 60, 33], [(50, 4000)] * 4  # 253 samples -> padded to 256
    results = run_distributed(_balance, 4, sizes, ranges, 8)
    work = _check(results, sizes, ranges, 8)
    assert max(work) / min(work) <= 1.001, work
    assert results[0][3]["global_seqlen/num_padding_samples"] == 3.0


def test_four_ranks_with_empty_ranks():
    sizes, ranges = [5, 0, 0, 2], [(3, 30)] * 4
    results = run_distributed(_balance, 4, sizes, ranges, 1)
    _check(results, sizes, ranges, 4)


def _callback_without_process_group():
    return SequenceBalancing().on_before_update(None, None, _rank_batch(0, 4, 5, 9))


def test_callback_is_a_no_op_without_distributed():
    assert _callback_without_process_group() is None
