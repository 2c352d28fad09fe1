from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_trainer.callbacks import Callback
from verl_trainer.callbacks.sequence_balancing import SequenceBalancing, balance_batch
from verl_trainer.core_algos.balancing import calculate_workload
from verl_trainer.data.tasks import ArithmeticTaskConfig, write_arithmetic_task
from verl_trainer.models.tiny import make_tiny_model
from verl_trainer.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]


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


class _AfterBalancing(Callback):
    """Records the batch each rank holds after SequenceBalancing (it runs after it)."""

    def __init__(self) -> None:
        self.seq_lens: list[list[int]] = []

    def on_before_update(self, trainer, module, batch):
        self.seq_lens.append(batch["seq_len"].tolist())


def _grpo_step_with_balancing(model_dir: str, data_dir: str, root: str):
    from verl_trainer import Trainer
    from verl_trainer.algorithms import GRPO, PromptDataModule
    from verl_trainer.models.loading import load_tokenizer
    from verl_trainer.recipe_config import GRPORecipeConfig, load_config

    cfg = load_config(GRPORecipeConfig, ROOT / "configs" / "grpo.yaml", [
        f"algorithm.model_path={model_dir}", f"data.train_files={data_dir}/train.jsonl",
        "data.val_files=null",
        "data.train_batch_size=8", "algorithm.rollout.n=2", "algorithm.rollout.max_new_tokens=3",
        "algorithm.actor.ppo_mini_batch_size=4", "algorithm.actor.engine.micro_batch_size_per_gpu=4",
    ])
    module = GRPO(cfg.algorithm)
    after = _AfterBalancing()
    trainer = Trainer(devices=2, max_steps=1, callbacks=[SequenceBalancing(), after], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, default_root_dir=root)
    trainer.fit(module, datamodule=PromptDataModule(cfg.data, load_tokenizer(model_dir)))
    metrics = dict(trainer.callback_metrics)
    # the same callback on long, varied lengths (where the workload model matters), with the run's module
    balancing = SequenceBalancing()
    new = balancing.on_before_update(trainer, module, _rank_batch(dist.get_rank(), 16, 50, 4000))
    after_rl, after_long = [None, None], [None, None]
    dist.all_gather_object(after_rl, after.seq_lens[0])
    dist.all_gather_object(after_long, new["seq_len"].tolist())
    return (module.hidden_size, module.required_batch_multiple, metrics, after_rl,
            balancing.last_metrics["global_seqlen/workload_imbalance"], after_long)


def _imbalance(per_rank: list[list[int]], hidden: int) -> float:
    loads = [float(calculate_workload(torch.tensor(lens), hidden_size=hidden).sum()) for lens in per_rank]
    mean = sum(loads) / len(loads)
    return (max(loads) - mean) / mean


def test_callback_uses_the_modules_hidden_size_and_batch_multiple(tmp_path):
    """Contract: the workload uses the actor's h (32, not 4096) and the module's multiple lcm(dp, mini × n).

    A valid config's batch is a multiple already (the mini-batch divides the batch, the DP size divides the
    batch): no padding here; the padding itself is tested in tests/test_balancing.py."""
    make_tiny_model(tmp_path / "model", hidden_size=32, num_attention_heads=4, num_key_value_heads=2, seed=1)
    task = ArithmeticTaskConfig(num_train=24, num_val=2, holdout_fraction=0.2)
    write_arithmetic_task(tmp_path / "data", task)
    results = run_distributed(_grpo_step_with_balancing, 2, str(tmp_path / "model"), str(tmp_path / "data"),
                              str(tmp_path / "run"), timeout=300)
    hidden, multiple, metrics, per_rank, imbalance, long_per_rank = results[0]
    assert hidden == 32 and multiple == 8  # lcm(dp=2, 4 prompts x n=2)
    assert [len(lens) for lens in per_rank] == [8, 8]  # 16 real samples, equal halves
    assert metrics["global_seqlen/num_padding_samples"] == 0.0
    assert metrics["global_seqlen/workload_imbalance"] == pytest.approx(_imbalance(per_rank, 32), abs=1e-12)
    with_h, with_default = _imbalance(long_per_rank, 32), _imbalance(long_per_rank, 4096)
    assert abs(with_h - with_default) > 1e-6  # the two workload models tell apart on this batch
    assert imbalance == pytest.approx(with_h, rel=1e-9)
