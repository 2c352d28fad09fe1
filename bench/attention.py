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

``--grid`` runs every layout of the grid: MHA 8 (8 query / 8 KV heads), MHA (4 / 4), GQA (4 / 2), MQA (4 / 1)
x head dim 32, 64, 128 x fp32, bf16 (``--layouts`` / ``--dims`` / ``--dtypes`` pick a part), on 1,024
segments of 8-16 tokens and two long-tailed workloads (log-normal, sigma 0.8: 64 segments of median 48,
256 of median 24). Each layout's crossover is first chosen by ``attention_autotune.tune`` as the engine does
at model build (its probe times HF's layout; the file cache is off, so every run measures it, and the time it
took is printed); then the packed path (``bucketed_varlen_attention`` as the model calls it) and the loop are
timed on q/k/v in HF's layout and, side by side in the same rounds, contiguous: each speed-up is against the
loop on the same inputs. Targets: >= 3x on the short workload where the matmul path is chosen, >= 0.95x on
the long-tailed ones, in HF's layout.

``--workloads`` times only the named workloads (more rounds where they matter, on a shared machine);
``--profile`` adds, per workload, a ``torch.profiler`` table of the new path's operators (self CPU time
over 5 fwd+bwd, after the timed rounds; the first ``--matmul-max-length``): where the time goes (gathers,
scatters, matmuls, sdpa, autograd). Neither changes how the speed-up is measured.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verl_trainer.models.attention_autotune import CACHE_ENV, ShapeKey, tune  # noqa: E402
from verl_trainer.models.bucketed_attention import (  # noqa: E402
    LAYOUT_CROSSOVERS,
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

    def log_normal(n: int, median: float, sigma: float) -> list[int]:
        lens = torch.exp(math.log(median) + sigma * torch.randn(n, generator=g)).round().clamp(1, 2048)
        return [int(x) for x in lens]

    def long_tailed(n: int, median: float = 128) -> list[int]:
        return log_normal(n, median, 1.0)

    return {"1024 x 8-16": short, "64 long-tailed": long_tailed(64), "256 long-tailed": long_tailed(256),
            "256 lt median 32": long_tailed(256, 32),
            "64 lt median 48": log_normal(64, 48, 0.8), "256 lt median 24": log_normal(256, 24, 0.8)}


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


GRID_LAYOUTS = {"MHA 8": (8, 8), "MHA": (4, 4), "GQA": (4, 2), "MQA": (4, 1)}
GRID_DIMS = (32, 64, 128)
GRID_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GRID_WORKLOADS = ("1024 x 8-16", "64 lt median 48", "256 lt median 24")
INPUT_LAYOUTS = {"hf": True, "contiguous": False}
"""The grid's input layouts: ``hf`` is what the model's attention receives (transposed views)."""


def profile_table(fn: Attention, inputs: Inputs, lens: list[int], rows: int = 15) -> str:
    """``torch.profiler`` table of ``fn``'s operators over 5 forward + backward passes (self CPU time)."""
    fwd_bwd(fn, inputs, lens)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            fwd_bwd(fn, inputs, lens)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def paired_layouts(
    fn: Attention, inputs: dict[str, Inputs], lens: list[int], reps: int
) -> dict[str, tuple[float, float]]:
    """Per input layout, ``(median loop time, median per-round loop / fn)``; all sides alternate per round."""
    for x in inputs.values():  # warm-up (and the plans' caches)
        fwd_bwd(fn, x, lens), fwd_bwd(reference_varlen_attention, x, lens)
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(reps):
        order = list(inputs) if r % 2 == 0 else list(inputs)[::-1]
        for layout in order:
            sides = (("loop", reference_varlen_attention), ("new", fn))
            for side, f in sides if r % 2 == 0 else sides[::-1]:
                times.setdefault((layout, side), []).append(fwd_bwd(f, inputs[layout], lens))
    return {
        layout: (
            statistics.median(times[layout, "loop"]),
            statistics.median(a / b for a, b in zip(times[layout, "loop"], times[layout, "new"])),
        )
        for layout in inputs
    }


def grid(reps: int, layouts: list[str], dims: list[int], dtypes: list[str]) -> None:
    """Layouts x head dims x dtypes x workloads: the packed path vs the loop, on both input layouts.

    The packed path runs as the engine runs it: the layout's crossover is first chosen by
    ``attention_autotune.tune`` (its probe times HF's transposed layout), then
    ``bucketed_varlen_attention`` reads it from the kernel's table. The autotune's file cache is off
    (``VERL_TRAINER_ATTENTION_AUTOTUNE_CACHE=0``), so every run measures its own crossover.
    """
    os.environ[CACHE_ENV] = "0"
    lengths = workloads()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {reps} paired rounds; speed-up = "
          "median over rounds of loop / packed (the loop on the same inputs); hf = q/k/v as transposed views "
          "of [1, N, H, D] (the model's layout), contiguous = [1, H, N, D]; crossover from "
          "attention_autotune.tune")
    print("| layout | D | dtype | crossover (tune ms) | " + " | ".join(
        f"{w}: loop ms hf, hf, contiguous" for w in GRID_WORKLOADS) + " |")
    print("|---|---|---|---|" + "---|" * len(GRID_WORKLOADS))
    for layout in layouts:
        heads, kv_heads = GRID_LAYOUTS[layout]
        for dim in dims:
            for dtype_name in dtypes:
                dtype = GRID_DTYPES[dtype_name]
                key = ShapeKey.of(heads, kv_heads, dim, dtype, "cpu")
                LAYOUT_CROSSOVERS.pop(key.layout, None)
                start = time.perf_counter()
                crossover = tune(key)
                tune_ms = (time.perf_counter() - start) * 1e3
                cells = []
                for name in GRID_WORKLOADS:
                    lens = lengths[name]
                    inputs = {lay: make_inputs(lens, heads, kv_heads, dim, hf, dtype=dtype)
                              for lay, hf in INPUT_LAYOUTS.items()}
                    tol = 1e-5 if dtype == torch.float32 else 1e-1
                    for x in inputs.values():
                        check_equal(bucketed_varlen_attention, reference_varlen_attention, x, lens, tol)
                    result = paired_layouts(bucketed_varlen_attention, inputs, lens, reps)
                    cells.append(f"{result['hf'][0] * 1e3:.0f}, {result['hf'][1]:.2f}x, "
                                 f"{result['contiguous'][1]:.2f}x")
                row = f"| {layout} {heads}/{kv_heads} | {dim} | {dtype_name} | {crossover} ({tune_ms:.0f}) "
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
                        help="layouts x D x dtypes: the tuned packed path vs the loop, both layouts")
    parser.add_argument("--layouts", nargs="+", default=list(GRID_LAYOUTS), choices=list(GRID_LAYOUTS),
                        help="--grid: only these attention layouts")
    parser.add_argument("--dims", nargs="+", type=int, default=list(GRID_DIMS), help="--grid: head dims")
    parser.add_argument("--dtypes", nargs="+", default=list(GRID_DTYPES), choices=list(GRID_DTYPES),
                        help="--grid: dtypes")
    args = parser.parse_args()
    if args.grid:
        grid(args.reps or 5, args.layouts, args.dims, args.dtypes)
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
