"""Packed attention on CPU: the bucketed path vs an efficient per-segment sdpa loop, fwd+bwd.

Usage::

    python bench/attention.py [--heads 4] [--kv-heads 2] [--head-dim 64] [--reps 7]
                              [--contiguous]

The baseline is ``reference_varlen_attention``: inputs split with ``torch.split`` into per-segment views,
one ``scaled_dot_product_attention`` per segment, one ``torch.cat`` — no copies beyond that, so only the
per-call overhead separates it from a fused kernel. The new path is ``varlen_attention`` (what the
``"verl_varlen"`` attention runs), which on CPU buckets segments of similar length into one sdpa call
each (``verl_trainer.models.bucketed_attention``). Each side runs a forward and a backward of the same
fp32 inputs; the two sides alternate, and the median of ``--reps`` timed repeats (after one warm-up)
is compared. The outputs and input gradients of both sides are checked equal (1e-5) first. q/k/v are
laid out as HF attention layers pass them (transposed views of ``[1, N, H, D]``, after the rotary
embedding too); ``--contiguous`` gives contiguous ``[1, H, N, D]`` instead, the loop's best case.

Workloads (heads 4 x 64 and 2 KV heads by default: the Qwen2 of ``bench/vs_trl.py``):

* 1,024 segments of 8-16 tokens (RL responses; per-call overhead dominates): target >= 3x;
* 64 and 256 segments of long-tailed lengths (lognormal, median 128, sigma 1, in [1, 2048]): >= 0.9x.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verl_trainer.models.bucketed_attention import bucketed_varlen_attention  # noqa: E402
from verl_trainer.models.varlen_kernels import reference_varlen_attention  # noqa: E402

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
Attention = Callable[..., torch.Tensor]


def workloads(seed: int = 0) -> dict[str, list[int]]:
    """Segment lengths of the three workloads."""
    g = torch.Generator().manual_seed(seed)
    short = torch.randint(8, 17, (1024,), generator=g).tolist()

    def long_tailed(n: int) -> list[int]:
        lens = torch.exp(math.log(128) + torch.randn(n, generator=g)).round().clamp(1, 2048)
        return [int(x) for x in lens]

    return {"1024 x 8-16": short, "64 long-tailed": long_tailed(64), "256 long-tailed": long_tailed(256)}


def make_inputs(
    lens: list[int], heads: int, kv_heads: int, dim: int, hf_layout: bool, seed: int = 0
) -> Inputs:
    """``q [1, H, N, D]``, ``k``, ``v`` and the output gradient ``[1, N, H, D]``.

    ``hf_layout``: q/k/v are transposed views of ``[1, N, H, D]`` (what HF attention layers pass);
    otherwise contiguous ``[1, H, N, D]`` (the loop's best case: contiguous per-segment views).
    """
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)

    def leaf(h: int) -> torch.Tensor:
        if hf_layout:
            return torch.randn(1, n, h, dim, generator=g).transpose(1, 2).requires_grad_(True)
        return torch.randn(1, h, n, dim, generator=g).requires_grad_(True)

    return leaf(heads), leaf(kv_heads), leaf(kv_heads), torch.randn(1, n, heads, dim, generator=g)


def fwd_bwd(fn: Attention, inputs: Inputs, lens: list[int]) -> float:
    """Seconds of one forward + backward (gradients cleared first)."""
    q, k, v, grad = inputs
    for x in (q, k, v):
        x.grad = None
    start = time.perf_counter()
    fn(q, k, v, lens).backward(grad)
    return time.perf_counter() - start


def check_equal(new: Attention, ref: Attention, inputs: Inputs, lens: list[int]) -> float:
    """Max abs difference of outputs and input gradients between the two sides (raises above 1e-5)."""
    results = []
    for fn in (new, ref):
        q, k, v, grad = inputs
        for x in (q, k, v):
            x.grad = None
        out = fn(q, k, v, lens)
        out.backward(grad)
        results.append([out.detach(), q.grad, k.grad, v.grad])
    diff = max(float((a - b).abs().max()) for a, b in zip(*results))
    if diff > 1e-5:
        raise AssertionError(f"the bucketed path differs from the reference by {diff:.2e}")
    return diff


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--contiguous", action="store_true",
                        help="contiguous [1, H, N, D] q/k/v (the loop's best case) instead of HF's layout")
    args = parser.parse_args()

    new = bucketed_varlen_attention
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, heads {args.heads} "
          f"(kv {args.kv_heads}) x {args.head_dim}, "
          f"{'contiguous' if args.contiguous else 'HF (transposed)'} q/k/v")
    for name, lens in workloads().items():
        inputs = make_inputs(lens, args.heads, args.kv_heads, args.head_dim, not args.contiguous)
        diff = check_equal(new, reference_varlen_attention, inputs, lens)
        times: dict[str, list[float]] = {"new": [], "loop": []}
        for _ in range(args.reps):
            times["new"].append(fwd_bwd(new, inputs, lens))
            times["loop"].append(fwd_bwd(reference_varlen_attention, inputs, lens))
        new_s, loop_s = statistics.median(times["new"]), statistics.median(times["loop"])
        print(f"{name:>16}: {sum(lens):6d} tokens, longest {max(lens):4d} | loop {loop_s * 1e3:7.1f} ms | "
              f"bucketed {new_s * 1e3:7.1f} ms | speed-up {loop_s / new_s:5.2f}x | max diff {diff:.1e}",
              flush=True)


if __name__ == "__main__":
    main()
