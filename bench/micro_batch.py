"""Dynamic micro-batching: our planner against verl 0.9.1's loop, measured in the same run.

For 256 samples with lengths uniform in [50, 4000] and token budgets 4096, 8192, 16384 it prints:
  * the micro-batch count of verl's loop (KK from ceil(total/budget) upwards until every part fits,
    bench/_verl_baseline.py) and ours, and the time of each (planning only: index lists; and ours with
    the TensorDict slicing of prepare_micro_batches);
  * over many random batches: how often our count is <= ceil(total/budget) + 1 (target >= 95% where
    the budget is at least twice the longest sample), and our count against
    max(ceil(total/budget), number of samples longer than budget/2), the bound bin packing can reach
    when samples come close to the budget;
  * that every micro-batch fits the budget, always.

Targets: never more micro-batches than verl, >= 20x faster than verl's loop.

Usage: python bench/micro_batch.py [--trials 200] [--verl-trials 5]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tensordict import TensorDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _verl_baseline import baseline_dynamic_micro_batches  # noqa: E402

from verl_trainer.engine.micro_batch import (  # noqa: E402
    micro_batch_lower_bound,
    plan_micro_batches,
    prepare_micro_batches,
)

BUDGETS = (4096, 8192, 16384)


def best_time(fn, runs: int) -> float:
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def make_batch(lens: np.ndarray) -> TensorDict:
    b, width = lens.size, int(lens.max())
    mask = (torch.arange(width)[None, :] < torch.from_numpy(lens)[:, None]).long()
    return TensorDict({"input_ids": mask * 7, "attention_mask": mask, "seq_len": torch.from_numpy(lens)},
                      batch_size=[b])


def bounds(lens: np.ndarray, budget: int) -> tuple[int, int]:
    """(ceil(total / budget), max(that, samples longer than budget / 2))."""
    l1 = math.ceil(int(lens.sum()) / budget)
    return l1, max(l1, int((lens > budget / 2).sum()))


def headline(budget: int) -> bool:
    lens = np.random.default_rng(0).integers(50, 4001, 256)
    t0 = time.perf_counter()
    verl = baseline_dynamic_micro_batches(lens.tolist(), budget)
    t_verl = time.perf_counter() - t0
    ours = plan_micro_batches(lens, budget)
    t_ours = best_time(lambda: plan_micro_batches(lens, budget), 20)
    batch = make_batch(lens)
    kwargs = {"use_dynamic_bsz": True, "max_token_len_per_gpu": budget}
    t_prep = best_time(lambda: prepare_micro_batches(batch, **kwargs), runs=5)
    fits = all(int(lens[p].sum()) <= budget for p in ours)
    l1, l2 = bounds(lens, budget)
    print(f"budget {budget:5d}: verl {len(verl):3d} micro-batches in {t_verl * 1e3:7.1f} ms"
          f" | ours {len(ours):3d} in {t_ours * 1e3:5.2f} ms ({t_verl / t_ours:4.0f}x) | all fit: {fits}")
    print(f"              prepare_micro_batches incl. TensorDict slicing {t_prep * 1e3:5.2f} ms"
          f" | ceil(total/budget) {l1}, with samples > budget/2 {l2},"
          f" Martello-Toth bound {micro_batch_lower_bound(lens, budget)}")
    return len(ours) <= len(verl) and t_verl / t_ours >= 20 and fits


def random_counts(budget: int, trials: int, verl_trials: int) -> bool:
    rng = np.random.default_rng(1000 + budget)
    within_l1, at_l2, optimal, excess, not_more, fits = 0, 0, 0, [], 0, True
    for trial in range(trials):
        lens = rng.integers(50, 4001, 256)
        parts = plan_micro_batches(lens, budget)
        fits &= all(int(lens[p].sum()) <= budget for p in parts)
        l1, l2 = bounds(lens, budget)
        within_l1 += len(parts) <= l1 + 1
        at_l2 += len(parts) <= l2
        optimal += len(parts) == micro_batch_lower_bound(lens, budget)
        excess.append(len(parts) - l2)
        if trial < verl_trials:
            not_more += len(parts) <= len(baseline_dynamic_micro_batches(lens.tolist(), budget))
    n_verl = min(trials, verl_trials)
    pct = 100 / trials
    print(f"budget {budget:5d}, {trials} random batches: all fit: {fits}"
          f" | <= verl's count in {not_more}/{n_verl}")
    print(f"              count <= ceil(total/budget)+1 in {within_l1 * pct:5.1f}%"
          f" | == max(ceil(total/budget), #samples > budget/2) in {at_l2 * pct:5.1f}%"
          f" (max excess {max(excess)}) | == Martello-Toth bound (provably minimal) in {optimal * pct:5.1f}%")
    ok = fits and not_more == n_verl
    if budget >= 2 * 4000:
        ok &= within_l1 >= 0.95 * trials
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--verl-trials", type=int, default=5, help="random batches also run through verl's loop")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ok = all([headline(b) for b in BUDGETS])
    ok &= all([random_counts(b, args.trials, args.verl_trials) for b in BUDGETS])
    print("all targets met" if ok else "TARGET MISSED")


if __name__ == "__main__":
    main()
