"""Sequence balancing: our Karmarkar-Karp against verl 0.9.1's style, measured in the same run.

Prints, for n=1024/k=8 and n=8192/k=64 (equal_size) and n=8192/k=64 (equal_size=False) with lengths
uniform in [50, 4000] balanced by workload (what verl's trainer does):
  * time of the textbook pure-Python heap KK (bench/_verl_baseline.py) on a list and on a tensor,
  * time of ours on a list and on a tensor, and the speed-up ratios,
  * partition quality (max - mean) / mean of the workloads, ours vs the baseline, on the same inputs.

Targets: >= 10x faster in all three cases, tensor input as fast as list input, quality no worse
than the baseline's and <= 1e-5.

Usage: python bench/balance.py [--seeds 3] [--tensor-baseline-all]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _verl_baseline import baseline_get_seqlen_balanced_partitions as baseline_partitions  # noqa: E402

from verl_trainer.core_algos.balancing import calculate_workload, get_seqlen_balanced_partitions  # noqa: E402

CASES = [(1024, 8, True), (8192, 64, True), (8192, 64, False)]


def best_times(fns: list[Callable[[], object]], budget_s: float, max_rounds: int = 500) -> list[float]:
    """Minimum wall time of each of ``fns``, run in turn (so they share the machine's load).

    At least one round, then rounds until about ``budget_s`` is spent. The garbage collector stays on,
    as in a training run.
    """
    best = [float("inf")] * len(fns)
    spent = 0.0
    gc.collect()
    for round_ in range(max_rounds):
        if round_ and spent >= budget_s:
            break
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            best[i] = min(best[i], dt)
            spent += dt
    return best


def imbalance(work: np.ndarray, parts: list[list[int]]) -> float:
    sums = np.array([work[p].sum() for p in parts], dtype=np.float64)
    return float((sums.max() - sums.mean()) / sums.mean())


def fmt(seconds: float) -> str:
    return f"{seconds * 1e3:9.3f} ms"


def time_case(n: int, k: int, equal_size: bool, tensor_baseline: bool) -> dict[str, float]:
    """Times of the baseline and ours on one input, as a list and as a tensor."""
    lens = np.random.default_rng(0).integers(50, 4001, n)
    work = calculate_workload(lens)
    as_list = work.tolist()
    as_tensor = torch.from_numpy(work.copy())
    budget = 1.0 if equal_size else 0.0  # the slow baseline runs once
    (base_list,) = best_times([lambda: baseline_partitions(as_list, k, equal_size)], budget)
    base_tensor = float("nan")
    if tensor_baseline:
        (base_tensor,) = best_times([lambda: baseline_partitions(as_tensor, k, equal_size)], budget)
    ours = best_times([lambda: get_seqlen_balanced_partitions(as_list, k, equal_size),
                       lambda: get_seqlen_balanced_partitions(as_tensor, k, equal_size)], 2.0)
    return {"base_list": base_list, "base_tensor": base_tensor, "ours_list": ours[0], "ours_tensor": ours[1]}


def quality(n: int, k: int, equal_size: bool, seed: int) -> tuple[float, float]:
    """(ours, baseline) partition imbalance on lengths uniform in [50, 4000] from ``seed``."""
    work = calculate_workload(np.random.default_rng(seed).integers(50, 4001, n))
    ours = imbalance(work, get_seqlen_balanced_partitions(work, k, equal_size))
    return ours, imbalance(work, baseline_partitions(work.tolist(), k, equal_size))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3, help="inputs per case for the quality comparison")
    ap.add_argument("--tensor-baseline-all", action="store_true",
                    help="also time the baseline on a tensor for n=8192 equal_size=False (minutes)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'case':28s} {'verl list':>12s} {'verl tensor':>12s} {'ours list':>12s} {'ours tensor':>12s}"
          f" {'x list':>7s} {'x tensor':>9s} {'t/l ours':>8s}")
    ok = True
    for n, k, equal_size in CASES:
        t = time_case(n, k, equal_size, tensor_baseline=equal_size or args.tensor_baseline_all)
        x_list = t["base_list"] / t["ours_list"]
        x_tensor = t["base_tensor"] / t["ours_tensor"]
        name = f"n={n} k={k} equal_size={equal_size}"
        same = t["ours_tensor"] / t["ours_list"]
        print(f"{name:28s} {fmt(t['base_list'])} {fmt(t['base_tensor'])} {fmt(t['ours_list'])}"
              f" {fmt(t['ours_tensor'])} {x_list:6.1f}x {x_tensor:8.1f}x {same:8.2f}")
        ok &= x_list >= 10 and (np.isnan(x_tensor) or x_tensor >= 10)
        for seed in range(args.seeds if equal_size else 1):
            q_ours, q_base = quality(n, k, equal_size, seed)
            good = q_ours <= q_base and q_ours <= 1e-5
            ok &= good
            print(f"    seed {seed}: quality (max-mean)/mean ours {q_ours:.3e}  verl-style {q_base:.3e}"
                  f"  {'ok' if good else 'WORSE'}")
    print("all targets met" if ok else "TARGET MISSED")


if __name__ == "__main__":
    main()
