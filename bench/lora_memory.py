"""Peak memory and step time of a LoRA (rank 16) train step vs. full fine-tuning, same model and batch, CPU.

Each mode runs in its own process (peak RSS is a per-process high-water mark): the parent writes one Llama
checkpoint, runs ``--mode full`` and ``--mode lora`` one after the other, and prints the ratios of the two
measured in this run. Per mode: an fsdp2 engine on one gloo rank, ``--steps`` optimizer steps (AdamW) on
the same batch; reported are the peak RSS growth over the process's RSS before the engine was built, the
median step time, the trainable parameters and the optimizer-state elements.

The defaults make the weights dominate (a 165M-parameter Llama, 2 x 128 tokens), the case LoRA is for:
full fine-tuning adds gradients and two AdamW moments (3 x the weights). Where activations dominate (large
batches) the peak is the end of the forward in both modes, before gradients or optimizer state exist, and
the two peaks are alike.

Usage: python bench/lora_memory.py [--hidden 1024] [--layers 8] [--vocab 32000] [--batch 2] [--len 128]
                                   [--steps 3] [--rank 16] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import build_batch, init_single_process, save_json, write_model  # noqa: E402


def _rss_mib() -> float:
    """Current resident set size of this process in MiB (Linux ``/proc/self/statm``)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def _peak_rss_mib() -> float:
    """Peak resident set size of this process so far in MiB (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_mode(args: argparse.Namespace) -> dict:
    """One mode in this process: build the engine, time ``args.steps`` train steps, measure memory."""
    from verl_trainer.engine import EngineConfig, EngineRegistry, GlobalBatchInfo, OptimConfig

    torch.set_num_threads(args.threads)
    init_single_process(torch.device("cpu"))
    lens = [args.len] * args.batch
    batch = build_batch(lens, args.vocab, seed=0)
    lora = {"lora_rank": args.rank, "lora_alpha": 2.0 * args.rank} if args.mode == "lora" else {}
    base_rss = _rss_mib()
    config = EngineConfig(model_path=args.model, micro_batch_size_per_gpu=args.batch, **lora)
    engine = EngineRegistry.new("language_model", "fsdp2", config, OptimConfig(lr=1e-4))
    engine.initialize()

    def loss_fn(out: dict, mb, info: GlobalBatchInfo):
        mask = mb["loss_mask"].float()
        loss = -(out["log_probs"] * mask).sum() / info.batch_num_tokens * info.dp_size
        return loss, {}

    times = []
    with engine.train_mode():
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.train_batch(batch, loss_fn)
            times.append(time.perf_counter() - t0)
    state = engine.optimizer.state
    optim_numel = sum(v.numel() for s in state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
    return {
        "mode": args.mode,
        "peak_rss_growth_mib": _peak_rss_mib() - base_rss,
        "step_s_median": statistics.median(times[1:] if len(times) > 1 else times),
        "trainable_params": engine.num_trainable_parameters(),
        "optimizer_state_numel": optim_numel,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--mode", choices=["full", "lora"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode is not None:  # a child: one mode, its result as the last line of stdout
        print(json.dumps(run_mode(args)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = str(Path(tmp) / "model")
        write_model(model, args.hidden, args.layers, args.vocab)
        results = {}
        for mode in ("full", "lora"):
            names = ("hidden", "layers", "vocab", "batch", "len", "steps", "rank", "threads")
            sizes = [f"--{k}={getattr(args, k)}" for k in names]
            cmd = [sys.executable, __file__, *sizes, "--mode", mode, "--model", model]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
            results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    full, lora = results["full"], results["lora"]
    print(f"Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; batch {args.batch} x "
          f"{args.len} tokens; fsdp2, 1 CPU rank, fp32, {args.steps} AdamW steps")
    for mode in ("full", "lora"):
        r = results[mode]
        print(f"  {mode:>4}: trainable {r['trainable_params']:>11,}  "
              f"optimizer state {r['optimizer_state_numel']:>11,}  "
              f"peak RSS growth {r['peak_rss_growth_mib']:8.1f} MiB  step {r['step_s_median']:.3f} s")
    ratios = {
        "peak_memory_full_over_lora": full["peak_rss_growth_mib"] / lora["peak_rss_growth_mib"],
        "step_time_full_over_lora": full["step_s_median"] / lora["step_s_median"],
        "trainable_full_over_lora": full["trainable_params"] / lora["trainable_params"],
    }
    print(f"  full / LoRA r={args.rank}: peak memory {ratios['peak_memory_full_over_lora']:.2f}x, "
          f"step time {ratios['step_time_full_over_lora']:.2f}x, "
          f"trainable parameters {ratios['trainable_full_over_lora']:.0f}x")
    save_json(args.json, {"config": vars(args), "results": results, "ratios": ratios})


if __name__ == "__main__":
    main()
