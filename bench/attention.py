"""Packed attention on CPU: the bucketed path vs an efficient per-segment sdpa loop, fwd+bwd.

Usage::

    python bench/attention.py [--heads 4] [--kv-heads 2] [--head-dim 64] [--reps 21]
                              [--contiguous] [--matmul-max-length 64 0 ...]
    python bench/attention.py --grid [--reps 5]
    python bench/attention.py --heads 4 --kv-heads 4 --head-dim 128 --workloads "1024 x 8-16" [--profile]

The baseline is ``reference_varlen_attention``: inputs split with ``torch.split`` into per-segment views,
one ``scaled_dot_product_attention`` per segment, one ``torch.cat`` — no copies beyond that, so only the
per-call overhead separates it from a fused kernel. The new path is ``bucketed_varlen_attention`` (what
the ``"verl_varlen"`` attention runs on CPU): segments of equal length form one bucket, buckets of up to
``--matmul-max-length`` tokens run as batched matmuls (the matmul bucket kernel of
``verl_trainer.models.bucketed_attention``), longer
ones one sdpa call each. Each side runs a forward and a backward of the same fp32 inputs; the sides
alternate within each of ``--reps`` rounds (after one warm-up), and the speed-up is the median over
rounds of loop time / new time in that round (the machine's load drifts between rounds; a round's two
timings share it); the median times are printed too. With several ``--matmul-max-length`` values each
is a side of its own (``0``: sdpa for every bucket, the previous path). The outputs and input
gradients of every side are checked against the loop (1e-5) first. q/k/v are
laid out as HF attention layers pass them (transposed views of ``[1, N, H, D]``, after the rotary
embedding too); ``--contiguous`` gives contiguous ``[1, H, N, D]`` instead, the loop's best case.

Workloads (heads 4 x 64 and 2 KV heads by default: the Qwen2 of ``bench/vs_trl.py``):

* 1,024 segments of 8-16 tokens (RL responses; per-call overhead dominates): target >= 3x;
* 64 and 256 segments of long-tailed lengths (lognormal, median 128, sigma 1, in [1, 2048]): >= 0.95x;
* 256 segments of long-tailed lengths with median 32 (the issue's "few dozen tokens"): >= 0.95x.

``--grid`` runs every layout of the grid: MHA (4 query / 4 KV heads), GQA (4 / 2), MQA (4 / 1) x head dim
32, 64, 128 x fp32, bf16, on the 1,024-short, 64 long-tailed and 256 long-tailed (median 32) workloads,
timing the loop, the old constant rule (matmul up to ``MATMUL_MAX_LENGTH``) and the new per-shape rule
(the crossover ``verl_trainer.models.attention_autotune`` measures for the layout, printed with the time
the autotune took) in paired rounds. Where both rules pick the same crossover they are one path, timed
once (``=`` in the new column). Under the old rule bf16 never takes the matmul path (sdpa buckets); the new
rule may (the bucket upcast to fp32 for the matmuls) where its probe measured it faster.

``--workloads`` times only the named workloads (more rounds where they matter, on a shared machine);
``--profile`` adds, per workload, a ``torch.profiler`` table of the new path's operators (self CPU time
over 5 fwd+bwd, after the timed rounds; the first ``--matmul-max-length``): where the time goes (gathers,
scatters, matmuls, sdpa, autograd). Neither changes how the speed-up is measured.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verl_trainer.models.attention_autotune import ShapeKey, choose_crossover  # noqa: E402
from verl_trainer.models.bucketed_attention import (  # noqa: E402
    MATMUL_MAX_LENGTH,
    bucketed_varlen_attention,
)
from verl_trainer.models.varlen_kernels import reference_varlen_attention  # noqa: E402

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
Attention = Callable[..., torch.Tensor]


def workloads(seed: int = 0) -> dict[str, list[int]]:
    """Segment lengths of the three workloads."""
    g = torch.Generator().manual_seed(seed)
    short = torch.randint(8, 17, (1024,), generator=g).tolist()

    def long_tailed(n: int, median: float = 128) -> list[int]:
        lens = torch.exp(math.log(median) + torch.randn(n, generator=g)).round().clamp(1, 2048)
        return [int(x) for x in lens]

    return {"1024 x 8-16": short, "64 long-tailed": long_tailed(64), "256 long-tailed": long_tailed(256),
            "256 lt median 32": long_tailed(256, 32)}


def make_inputs(
    lens: list[int], heads: int, kv_heads: int, dim: int, hf_layout: bool, seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Inputs:
    """``q [1, H, N, D]``, ``k``, ``v`` and the output gradient ``[1, N, H, D]``.

    ``hf_layout``: q/k/v are transposed views of ``[1, N, H, D]`` (what HF attention layers pass);
    otherwise contiguous ``[1, H, N, D]`` (the loop's best case: contiguous per-segment views).
    """
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)

    def leaf(h: int) -> torch.Tensor:
        if hf_layout:
            return torch.randn(1, n, h, dim, generator=g, dtype=dtype).transpose(1, 2).requires_grad_(True)
        return torch.randn(1, h, n, dim, generator=g, dtype=dtype).requires_grad_(True)

    grad = torch.randn(1, n, heads, dim, generator=g, dtype=dtype)
    return leaf(heads), leaf(kv_heads), leaf(kv_heads), grad


def fwd_bwd(fn: Attention, inputs: Inputs, lens: list[int]) -> float:
    """Seconds of one forward + backward (gradients cleared first)."""
    q, k, v, grad = inputs
    for x in (q, k, v):
        x.grad = None
    start = time.perf_counter()
    fn(q, k, v, lens).backward(grad)
    return time.perf_counter() - start


def check_equal(new: Attention, ref: Attention, inputs: Inputs, lens: list[int], tol: float = 1e-5) -> float:
    """Max abs difference of outputs and input gradients between the two sides (raises above ``tol``)."""
    results = []
    for fn in (new, ref):
        q, k, v, grad = inputs
        for x in (q, k, v):
            x.grad = None
        out = fn(q, k, v, lens)
        out.backward(grad)
        results.append([out.detach(), q.grad, k.grad, v.grad])
    diff = max(float((a - b).abs().max()) for a, b in zip(*results))
    if diff > tol:
        raise AssertionError(f"the new path differs from the reference by {diff:.2e}")
    return diff


def paired(sides: dict[str, Attention], inputs: Inputs, lens: list[int], reps: int
           ) -> tuple[float, dict[str, tuple[float, float]]]:
    """Loop time and, per side, ``(median time, median per-round speed-up)``: sides alternate per round."""
    for fn in (*sides.values(), reference_varlen_attention):  # warm-up (and the plans' caches)
        fwd_bwd(fn, inputs, lens)
    times: dict[str, list[float]] = {side: [] for side in (*sides, "loop")}
    for _ in range(reps):
        times["loop"].append(fwd_bwd(reference_varlen_attention, inputs, lens))
        for side, fn in sides.items():
            times[side].append(fwd_bwd(fn, inputs, lens))
    result = {}
    for side in sides:
        ratios = [a / b for a, b in zip(times["loop"], times[side])]
        result[side] = (statistics.median(times[side]), statistics.median(ratios))
    return statistics.median(times["loop"]), result


GRID_LAYOUTS = {"MHA": (4, 4), "GQA": (4, 2), "MQA": (4, 1)}
GRID_DIMS = (32, 64, 128)
GRID_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GRID_WORKLOADS = ("1024 x 8-16", "64 long-tailed", "256 lt median 32")


def profile_table(fn: Attention, inputs: Inputs, lens: list[int], rows: int = 15) -> str:
    """``torch.profiler`` table of ``fn``'s operators over 5 forward + backward passes (self CPU time)."""
    fwd_bwd(fn, inputs, lens)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            fwd_bwd(fn, inputs, lens)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def grid(reps: int) -> None:
    """Every layout x head dim x dtype x workload: loop vs the old constant rule vs the per-shape rule."""
    lengths = workloads()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, HF (transposed) q/k/v, "
          f"{reps} paired rounds; speed-up = median over rounds of loop / side; "
          f"old = matmul up to {MATMUL_MAX_LENGTH}, new = the layout's measured crossover")
    print("| layout | D | dtype | crossover old → new (tune ms) | " + " | ".join(
        f"{w}: loop ms, old, new" for w in GRID_WORKLOADS) + " |")
    print("|---|---|---|---|" + "---|" * len(GRID_WORKLOADS))
    for layout, (heads, kv_heads) in GRID_LAYOUTS.items():
        for dim in GRID_DIMS:
            for dtype_name, dtype in GRID_DTYPES.items():
                key = ShapeKey.of(heads, kv_heads, dim, dtype, "cpu")
                start = time.perf_counter()
                new = choose_crossover(key)
                tune_ms = (time.perf_counter() - start) * 1e3
                old = MATMUL_MAX_LENGTH if dtype == torch.float32 else 0  # the constant rule: fp32 only
                maxes = {"old": old, "new": new}
                sides = {f"m{m}": functools.partial(bucketed_varlen_attention, matmul_max_length=m)
                         for m in sorted(set(maxes.values()))}
                cells = []
                for name in GRID_WORKLOADS:
                    lens = lengths[name]
                    inputs = make_inputs(lens, heads, kv_heads, dim, True, dtype=dtype)
                    tol = 1e-5 if dtype == torch.float32 else 1e-1
                    for fn in sides.values():
                        check_equal(fn, reference_varlen_attention, inputs, lens, tol)
                    loop_s, result = paired(sides, inputs, lens, reps)
                    ratio_old, ratio_new = result[f"m{old}"][1], result[f"m{new}"][1]
                    same = "=" if old == new else ""
                    cells.append(f"{loop_s * 1e3:.0f}, {ratio_old:.2f}x, {same}{ratio_new:.2f}x")
                row = f"| {layout} {heads}/{kv_heads} | {dim} | {dtype_name} | {old} → {new} ({tune_ms:.0f}) "
                print(row + "| " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=None, help="paired rounds (default 21; 5 with --grid)")
    parser.add_argument("--contiguous", action="store_true",
                        help="contiguous [1, H, N, D] q/k/v (the loop's best case) instead of HF's layout")
    parser.add_argument("--matmul-max-length", type=int, nargs="+", default=[MATMUL_MAX_LENGTH],
                        help="buckets up to this length run batched matmuls (0: sdpa); several: a side each")
    parser.add_argument("--workloads", nargs="+", default=None, choices=list(workloads()),
                        help="time only these workloads (default: all)")
    parser.add_argument("--profile", action="store_true",
                        help="also print a torch.profiler table of the new path per workload")
    parser.add_argument("--grid", action="store_true",
                        help="every layout (MHA/GQA/MQA x D 32/64/128 x fp32/bf16): old vs per-shape rule")
    args = parser.parse_args()
    if args.grid:
        grid(args.reps or 5)
        return
    reps = args.reps or 21

    sides: dict[str, Attention] = {
        f"new(matmul<={m})": functools.partial(bucketed_varlen_attention, matmul_max_length=m)
        for m in args.matmul_max_length
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, heads {args.heads} "
          f"(kv {args.kv_heads}) x {args.head_dim}, "
          f"{'contiguous' if args.contiguous else 'HF (transposed)'} q/k/v, {reps} rounds")
    for name, lens in workloads().items():
        if args.workloads is not None and name not in args.workloads:
            continue
        inputs = make_inputs(lens, args.heads, args.kv_heads, args.head_dim, not args.contiguous)
        diff = max(check_equal(fn, reference_varlen_attention, inputs, lens) for fn in sides.values())
        loop_s, result = paired(sides, inputs, lens, reps)
        cells = [f"{side} {median_s * 1e3:7.1f} ms, speed-up {ratio:5.2f}x"
                 for side, (median_s, ratio) in result.items()]
        print(f"{name:>16}: {sum(lens):6d} tokens, longest {max(lens):4d} | loop {loop_s * 1e3:7.1f} ms | "
              f"{' | '.join(cells)} | max diff {diff:.1e}", flush=True)
        if args.profile:
            print(profile_table(next(iter(sides.values())), inputs, lens), flush=True)


if __name__ == "__main__":
    main()
