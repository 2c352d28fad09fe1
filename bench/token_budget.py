"""Step time vs the micro-batch token budget (``EngineConfig.max_token_len_per_gpu``), per model size.

Usage::

    python bench/token_budget.py [--budgets 2048 4096 8192 16384 32768] [--samples 32] [--reps 3]
                                 [--models tiny wide]

One optimizer step (fwd, bwd, clip, AdamW) of the fsdp2 engine with ``use_dynamic_bsz=True`` (the
``Ours`` side of ``bench/step_throughput.py``, a 1-rank process group) on one batch of ``--samples``
long-tailed samples (lognormal, median 256, in [20, 2048]: ``bench/_common.py``), for each model:

* ``tiny``: the demo's default model (``configs/recipes.py: TinyModelConfig``: Qwen2, hidden 64,
  2 layers, 4 / 2 heads, the character vocabulary);
* ``wide``: the same architecture at hidden 512, 8 layers, 8 / 4 heads.

Every budget is an engine of its own over the same weights; the engines alternate within each of
``--reps`` paired rounds, each round starting at the next budget (after one warm-up step, which also
checks that every budget gives the same loss), and a budget's speed-up is the median over rounds of the
baseline's step time / its step time in that round; the baseline is 4,096 tokens (what
``bench/step_throughput.py`` runs). The budget must hold the longest sample (2,048 tokens).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import MAX_LEN, build_batch, init_single_process, sample_lengths  # noqa: E402
from step_throughput import Ours  # noqa: E402

from verl_trainer.engine import OptimConfig  # noqa: E402
from verl_trainer.models import make_tiny_model  # noqa: E402

BASELINE = 4096
MODELS = {
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
    "wide": {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4},
}


def measure(name: str, budgets: list[int], samples: int, reps: int) -> None:
    """Print one table row per budget for model ``name``."""
    lens = sample_lengths(samples, 256.0, 1.0, seed=0)
    optim = OptimConfig(lr=1e-4, weight_decay=0.0, clip_grad=1.0)
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_model(tmp, max_position_embeddings=MAX_LEN, **MODELS[name])
        vocab = json.loads((Path(tmp) / "config.json").read_text())["vocab_size"]
        batch = build_batch(lens, vocab, seed=0)
        sides = {b: Ours(tmp, b, optim, "float32") for b in sorted({BASELINE, *budgets})}
        n_params = sum(p.numel() for p in sides[BASELINE].engine.module.parameters())
        first = {b: side.step(batch) for b, side in sides.items()}
        spread = max(first.values()) - min(first.values())
        times: dict[int, list[float]] = {b: [] for b in sides}
        order = list(sides.items())
        for rep in range(reps):  # each round starts at another budget (the first call of a round is slower)
            for b, side in order[rep % len(order):] + order[:rep % len(order)]:
                t0 = time.perf_counter()
                side.step(batch)
                times[b].append(time.perf_counter() - t0)
    tokens = sum(lens)
    print(f"\n{name}: {n_params / 1e6:.2f}M params {MODELS[name]}; {samples} samples, {tokens} tokens "
          f"(longest {max(lens)}); first-step losses differ by at most {spread:.1e}")
    print("| model | budget | micro-batches | step s | tokens/s | speed-up vs 4096 |")
    print("|---|---|---|---|---|---|")
    for b, side in sides.items():
        ratio = statistics.median(x / y for x, y in zip(times[BASELINE], times[b]))
        med = statistics.median(times[b])
        print(f"| {name} | {b} | {side.num_micro_batches} | {med:.2f} | {tokens / med:.0f} | {ratio:.2f}x |",
              flush=True)


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--budgets", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    args = parser.parse_args()
    if min(args.budgets) < MAX_LEN:
        sys.exit(f"--budgets {min(args.budgets)} is below the longest sample ({MAX_LEN}); use >= {MAX_LEN}")
    init_single_process(torch.device("cpu"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, {args.reps} paired rounds")
    for name in args.models:
        measure(name, args.budgets, args.samples, args.reps)


if __name__ == "__main__":
    main()
