"""One training step per engine backend on the same model and batch, against fsdp2 measured in the same run.

Each side is a registered engine backend (``--strategy``, one or more; fsdp2 is always the baseline) built
on one rank from the same HF checkpoint (a Llama, head dim 64) with the same settings: dynamic
micro-batching at ``--budget`` tokens, an SFT token-mean loss, AdamW. One step is ``train_batch`` on a
batch of long-tailed lengths (lognormal, clipped to [20, 2048]). The sides alternate within every repeat
(these machines are noisy); the median step time of each is printed with its ratio to fsdp2
(``> 1``: slower than fsdp2), and the first step's losses, which must agree.

A backend on its own library runs in its own venv (``.venv-torchtitan``, ``.venv-megatron``):

    .venv-torchtitan/bin/python bench/backend_step.py --strategy torchtitan
    .venv-megatron/bin/python bench/backend_step.py --strategy megatron --json bench/results/backend_mg.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import build_batch, init_single_process, sample_lengths, save_json, write_model  # noqa: E402

from verl_trainer.core_algos.losses import SFTLossConfig, sft_loss  # noqa: E402
from verl_trainer.engine import EngineConfig, EngineRegistry, OptimConfig  # noqa: E402
from verl_trainer.utils.threads import apply_thread_env_defaults  # noqa: E402

BASELINE = "fsdp2"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", nargs="+", required=True, help="backends to time beside fsdp2")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--median-len", type=float, default=128.0)
    p.add_argument("--sigma", type=float, default=0.8)
    p.add_argument("--budget", type=int, default=2048, help="max_token_len_per_gpu of every side")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=str, default=None, help="also write the results here")
    args = p.parse_args()
    known = EngineRegistry.backends()
    unknown = [s for s in args.strategy if s not in known]
    if unknown:
        p.error(f"--strategy {unknown} not registered here; registered: {', '.join(known)} "
                f"(a library backend needs its own venv, see the usage above)")
    return args


def main() -> None:
    apply_thread_env_defaults()
    args = parse_args()
    import torch

    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):  # what DeepSpeed reads
        os.environ.setdefault(name, value)
    init_single_process(torch.device("cpu"))
    lens = sample_lengths(args.samples, args.median_len, args.sigma, args.seed, cap_one=False)
    batch = build_batch(lens, args.vocab, args.seed)
    loss_fn = sft_loss(SFTLossConfig(loss_agg_mode="token-mean"))
    optim = OptimConfig(lr=1e-5, weight_decay=0.0, clip_grad=1.0)
    names = [BASELINE, *[s for s in args.strategy if s != BASELINE]]
    with tempfile.TemporaryDirectory() as tmp:
        write_model(tmp, args.hidden, args.layers, args.vocab)
        config = EngineConfig(model_path=tmp, use_dynamic_bsz=True, max_token_len_per_gpu=args.budget)
        engines = {}
        for name in names:
            engines[name] = EngineRegistry.new("language_model", name, config, optim)
            engines[name].initialize()
        times: dict[str, list[float]] = {name: [] for name in names}
        first: dict[str, float] = {}
        for _ in range(args.repeats + 1):  # the first round warms up and is not timed
            for name, engine in engines.items():
                start = time.perf_counter()
                with engine.train_mode():
                    out = engine.train_batch(batch, loss_fn)
                elapsed = time.perf_counter() - start
                if name not in first:
                    first[name] = float(out["loss"])
                else:
                    times[name].append(elapsed)
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"{len(lens)} samples, {sum(lens):,} tokens, Llama hidden {args.hidden} x {args.layers} layers, "
          f"budget {args.budget}, {args.repeats} repeats, 1 rank, CPU fp32")
    print(f"{'side':12s} {'median step s':>14s} {'/ fsdp2':>8s} {'first loss':>12s}")
    for name in names:
        print(f"{name:12s} {median[name]:14.3f} {median[name] / median[BASELINE]:8.2f} {first[name]:12.6f}")
    save_json(args.json, {"tokens": sum(lens), "samples": len(lens), "hidden": args.hidden,
                          "layers": args.layers, "repeats": args.repeats, "median_s": median,
                          "ratio_vs_fsdp2": {n: median[n] / median[BASELINE] for n in names},
                          "first_loss": first})


if __name__ == "__main__":
    main()
