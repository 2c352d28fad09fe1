"""Chunked float32 log-probs + entropy (``data/log_probs.py``): speed of each chunk size, fwd+bwd.

Usage::

    python bench/log_softmax.py [--vocabs 32000 50257 128256 151936] [--tokens 256 1024]
                                [--dtypes fp32 bf16] [--budgets 1 4 16 64] [--reps 5]

For every vocabulary ``V`` x token count ``n`` x logits dtype it times one forward and backward of
``chunked_log_probs_and_entropy(logits [n, V], targets, calculate_entropy=True)`` (the loss
``log_probs @ w1 + entropy @ w2``) at several float32 element budgets per chunk (``--budgets``, in Mi
elements: ``chunk = max(1, budget // V)`` tokens) and as one chunk of all ``n`` tokens. The baseline is
the shipped rule (``CHUNK_ELEMENTS``). The sides alternate within each of ``--reps`` paired rounds (after
one warm-up), each round starting at the next side (the first call of a round is slower, whichever side
it is, so a fixed order would bias the result); a side's speed-up is the
median over rounds of baseline time / side time in that round (a round's timings share the machine's
load). The float32 values and
gradients of every side are checked against one unchunked float32 ``log_softmax`` first (1e-5 absolute
plus 1e-4 relative: summing 128k float32 terms in another order moves a log-prob of -5 by up to 7e-5; the
unit tests hold values to 1e-5 and gradients to 1e-6 at small vocabularies, ``tests/data/test_log_probs.py``).

A cell is ``=`` where the budget gives the same chunk as the baseline or a budget left of it (the same
code; not timed again). The ``chunk MiB`` figure is the size of one float32 ``[chunk, V]`` copy (the
backward holds about three: the upcast logits, ``log p`` and ``p``); the logits themselves are ``n * V``
elements in their dtype.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verl_trainer.data.log_probs import CHUNK_ELEMENTS, chunked_log_probs_and_entropy  # noqa: E402

MI = 1 << 20
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def make_inputs(n: int, vocab: int, dtype: torch.dtype, seed: int = 0) -> Inputs:
    """``logits [n, V]`` (leaf, ``dtype``), ``targets [n]``, loss weights ``w_lp [n]``, ``w_ent [n]``."""
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(n, vocab, generator=g)).to(dtype).requires_grad_(True)
    targets = torch.randint(0, vocab, (n,), generator=g)
    return logits, targets, torch.randn(n, generator=g), torch.randn(n, generator=g)


def fwd_bwd(chunk_elements: int, inputs: Inputs) -> float:
    """Seconds of one forward + backward at ``chunk_elements`` float32 elements per chunk."""
    logits, targets, w_lp, w_ent = inputs
    logits.grad = None
    start = time.perf_counter()
    lp, ent = chunked_log_probs_and_entropy(logits, targets, 1.0, True, chunk_elements)
    (lp @ w_lp + ent @ w_ent).backward()
    return time.perf_counter() - start


def check_equal(chunk_elements: int, inputs: Inputs) -> None:
    """Values and gradients at ``chunk_elements`` equal one unchunked float32 log-softmax (fp32 inputs)."""
    logits, targets, w_lp, w_ent = inputs
    logits.grad = None
    lp, ent = chunked_log_probs_and_entropy(logits, targets, 1.0, True, chunk_elements)
    (lp @ w_lp + ent @ w_ent).backward()
    got = logits.grad
    ref = logits.detach().float().requires_grad_(True)
    log_p = torch.log_softmax(ref, -1)
    want_lp, want_ent = log_p.gather(-1, targets[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)
    (want_lp @ w_lp + want_ent @ w_ent).backward()
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=1e-4)
    if logits.dtype == torch.float32:
        torch.testing.assert_close(got, ref.grad, atol=1e-5, rtol=1e-4)
    logits.grad = None


def paired(sides: dict[str, int], inputs: Inputs, reps: int) -> tuple[float, dict[str, tuple[float, float]]]:
    """Baseline median seconds and, per side, ``(median seconds, median per-round speed-up)``."""
    for elements in sides.values():
        fwd_bwd(elements, inputs)
    fwd_bwd(CHUNK_ELEMENTS, inputs)
    order = [("base", CHUNK_ELEMENTS), *sides.items()]
    times: dict[str, list[float]] = {side: [] for side, _ in order}
    for rep in range(reps):  # each round starts at another side: the first call of a round runs slower
        for side, elements in order[rep % len(order):] + order[:rep % len(order)]:
            times[side].append(fwd_bwd(elements, inputs))
    result = {side: (statistics.median(times[side]),
                     statistics.median(b / s for b, s in zip(times["base"], times[side]))) for side in sides}
    return statistics.median(times["base"]), result


def distinct_sides(budgets: list[int], n: int, vocab: int) -> dict[str, int]:
    """Budgets (and one chunk of all ``n``) whose chunk, in tokens, differs from the baseline's and earlier
    ones': a budget giving the same chunk runs the same code, so it is not timed again (``=``)."""
    seen = {min(n, max(1, CHUNK_ELEMENTS // vocab))}
    sides = {}
    for name, elements in [(f"{b / MI:g} Mi", b) for b in budgets] + [("all", n * vocab)]:
        rows = min(n, max(1, elements // vocab))
        if rows not in seen:
            seen.add(rows)
            sides[name] = elements
    return sides


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--vocabs", type=int, nargs="+", default=[32000, 50257, 128256, 151936])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--budgets", type=float, nargs="+", default=[1, 4, 16, 64],
                        help="float32 Mi elements per chunk (fractions allowed: 0.25 = 256 Ki)")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    budgets = [int(b * MI) for b in args.budgets if int(b * MI) != CHUNK_ELEMENTS]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.reps} paired rounds; "
          f"baseline CHUNK_ELEMENTS = {CHUNK_ELEMENTS / MI:g} Mi; cell = speed-up vs baseline "
          f"(chunk tokens, chunk MiB); 'all' = one chunk of n tokens; "
          f"'=' = the same chunk as the baseline or a column to its left")
    heads = [f"{b / MI:g} Mi" for b in budgets] + ["all"]
    print("| V | n | dtype | baseline ms (chunk) | " + " | ".join(heads) + " |")
    print("|---|---|---|---|" + "---|" * len(heads))
    for vocab in args.vocabs:
        for n in args.tokens:
            for dtype_name in args.dtypes:
                inputs = make_inputs(n, vocab, DTYPES[dtype_name])
                sides = distinct_sides(budgets, n, vocab)
                for elements in (CHUNK_ELEMENTS, *sides.values()):
                    check_equal(elements, inputs)
                base_s, result = paired(sides, inputs, args.reps)

                def rows(elements: int, n: int = n, vocab: int = vocab) -> int:
                    return min(n, max(1, elements // vocab))

                cells = []
                for side in heads:
                    if side in sides:
                        e = sides[side]
                        cells.append(f"{result[side][1]:.2f}x ({rows(e)}, {rows(e) * vocab * 4 / MI:.0f})")
                    else:
                        cells.append("=")
                print(f"| {vocab} | {n} | {dtype_name} | {base_s * 1e3:.0f} ({rows(CHUNK_ELEMENTS)}) | "
                      + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
