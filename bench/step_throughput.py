"""Training-step throughput: our engine (dynamic micro-batching + packing) against padded micro-batches.

One optimizer step (forward, backward, clip, AdamW) of a ~17M-parameter Llama on one batch of samples
whose lengths are long-tailed (lognormal, clipped to [20, 2048]), measured side by side in one process:

* ``ours``: the fsdp2 engine (``fully_shard`` on a 1-rank mesh) with ``use_dynamic_bsz=True`` and
  ``max_token_len_per_gpu=--budget``: micro-batches planned by token budget, each packed into one row
  without padding, varlen attention, a global token-mean denominator;
* ``padded mbs=k``: what a plain HF / Lightning user writes: a fixed number of samples per micro-batch
  in data order, each micro-batch right-padded to its longest sample (``DataCollatorWithPadding``),
  sdpa with the padding mask, the same loss (token-mean over the step), gradient accumulation. With a
  fixed size, the size that is safe for memory is ``budget // max_len`` (the longest sample may land in
  any micro-batch): the first baseline; a larger one (more memory than our budget) is shown too.

The sides alternate within every repeat (these machines are noisy) and the median step time is used.
Every side computes the same loss on the same weights: the first step's losses are printed and must
agree. MFU = useful model FLOPs (real tokens only, causal attention counted once) / the peak matmul rate
of this device measured here (``torch.mm`` of large square matrices, fp32 and bf16).

Target: ours >= 2x the tokens/s of the padded baseline.

Usage: python bench/step_throughput.py [--samples 32] [--budget 4096] [--repeats 3] [--dtype fp32|bf16]
       python bench/step_throughput.py --device cuda --dtype bf16 --hidden 1024 --layers 8 --samples 128
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    MAX_LEN,
    MIN_LEN,
    build_batch,
    init_single_process,
    sample_lengths,
    save_json,
    sync,
    write_model,
)

from verl_trainer.core_algos.losses import sft_loss  # noqa: E402
from verl_trainer.engine import EngineConfig, EngineRegistry, OptimConfig  # noqa: E402


def step_flops(config: LlamaConfig, lens: list[int]) -> float:
    """Useful FLOPs of one training step (3x forward) on real tokens; causal attention counted once."""
    h, d = config.hidden_size, config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    linear = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size
    tokens = sum(lens)
    fwd = 2 * tokens * (config.num_hidden_layers * linear + h * config.vocab_size)
    fwd += config.num_hidden_layers * sum(4 * q * n * (n + 1) / 2 for n in lens)
    return 3.0 * fwd


def peak_matmul_flops(device: torch.device, dtype: torch.dtype, size: int) -> float:
    """Best FLOP/s of ``torch.mm`` of two ``[size, size]`` matrices (the device's practical peak)."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    best = float("inf")
    for _ in range(6):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        sync(device)
        best = min(best, (time.perf_counter() - t0) / 4)
    return 2 * size**3 / best


# ------------------------------------------------------------------------------ the two sides
class Ours:
    """The fsdp2 language-model engine with dynamic micro-batching (one process, 1-rank mesh)."""

    def __init__(self, path: str, budget: int, optim: OptimConfig, param_dtype: str) -> None:
        cfg = EngineConfig(model_path=path, use_dynamic_bsz=True, max_token_len_per_gpu=budget,
                           param_dtype=param_dtype)
        self.engine = EngineRegistry.new("language_model", "fsdp2", cfg, optim)
        self.engine.initialize()
        self.loss_fn = sft_loss()
        self.num_micro_batches = 0

    def step(self, batch) -> float:
        with self.engine.train_mode():
            out = self.engine.train_batch(batch, self.loss_fn)
        self.num_micro_batches = out["num_micro_batches"]
        return out["loss"]


class Padded:
    """Plain HF model + AdamW: fixed-size micro-batches padded to their longest sample, sdpa."""

    def __init__(self, path: str, mbs: int, optim: OptimConfig, device: torch.device,
                 autocast_dtype: torch.dtype | None) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa",
                                                          dtype=torch.float32).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps,
                                     weight_decay=optim.weight_decay)
        self.mbs, self.device, self.clip = mbs, device, optim.clip_grad
        self.autocast_dtype = autocast_dtype
        self.num_micro_batches = 0
        self.padded_tokens = 0

    def step(self, batch) -> float:
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        denom = float(batch["loss_mask"].sum())  # the step's token-mean denominator
        total, self.padded_tokens = 0.0, 0
        chunks = range(0, batch.batch_size[0], self.mbs)
        for start in chunks:
            mb = batch[start:start + self.mbs]
            width = int(mb["seq_len"].max())
            ids = mb["input_ids"][:, :width].to(self.device)
            attn = mb["attention_mask"][:, :width].to(self.device)
            mask = mb["loss_mask"][:, 1:width].to(self.device)
            self.padded_tokens += ids.numel()
            ctx = (torch.autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast_dtype
                   else contextlib.nullcontext())
            with ctx:
                logits = self.model(input_ids=ids, attention_mask=attn, use_cache=False).logits
            nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")
            loss = (nll * mask).sum() / denom
            loss.backward()
            total += loss.item()
        self.num_micro_batches = len(chunks)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        return total


# ------------------------------------------------------------------------------ measurement
def timed(side, batch, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    side.step(batch)
    sync(device)
    return time.perf_counter() - t0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--median-len", type=float, default=256.0)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--budget", type=int, default=4096, help="our max_token_len_per_gpu")
    p.add_argument("--baseline-mbs", type=str, default="",
                   help="comma-separated; default budget // 2048 and 4x that")
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=str, default=None, help="also write the results here (for plot_results.py)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here")
    if args.budget < MAX_LEN:
        sys.exit(f"--budget {args.budget} must be >= the longest sample ({MAX_LEN}); raise it")
    safe = max(1, args.budget // MAX_LEN)
    mbs_list = [int(x) for x in args.baseline_mbs.split(",")] if args.baseline_mbs else [safe, 4 * safe]
    init_single_process(device)
    lens = sample_lengths(args.samples, args.median_len, args.sigma, args.seed)
    optim = OptimConfig(lr=1e-4, weight_decay=0.0, clip_grad=1.0)
    bf16 = args.dtype == "bf16"
    with tempfile.TemporaryDirectory() as tmp:
        path, config = tmp, write_model(tmp, args.hidden, args.layers, args.vocab)
        batch = build_batch(lens, args.vocab, args.seed)
        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())
        sides = {"ours": Ours(path, args.budget, optim, "bfloat16" if bf16 else "float32")}
        for mbs in mbs_list:
            sides[f"padded mbs={mbs}"] = Padded(path, mbs, optim, device, torch.bfloat16 if bf16 else None)
        first = {name: side.step(batch) for name, side in sides.items()}  # warm-up, and the same loss
        times: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(args.repeats):
            for name, side in sides.items():
                times[name].append(timed(side, batch, device))
    report(args, config, n_params, lens, sides, first, times, device)


def report(args, config, n_params, lens, sides, first, times, device) -> None:
    tokens = sum(lens)
    flops = step_flops(config, lens)
    size = 8192 if device.type == "cuda" else 2048
    peaks = {"fp32": peak_matmul_flops(device, torch.float32, size),
             "bf16": peak_matmul_flops(device, torch.bfloat16, size)}
    print(f"model: Llama {n_params / 1e6:.1f}M params (hidden {config.hidden_size}, "
          f"{config.num_hidden_layers} layers, vocab {config.vocab_size}); step dtype {args.dtype}; "
          f"device {device}; torch threads {torch.get_num_threads()}")
    print(f"batch: {len(lens)} samples, {tokens} tokens, lengths lognormal(median {args.median_len:g}, "
          f"sigma {args.sigma:g}) in [{MIN_LEN}, {MAX_LEN}]: min {min(lens)}, median "
          f"{int(statistics.median(lens))}, max {max(lens)}")
    print(f"peak matmul (torch.mm {size}x{size}): fp32 {peaks['fp32'] / 1e9:.1f} GFLOP/s, "
          f"bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s; useful FLOPs per step {flops / 1e9:.1f} G")
    print("first-step loss: " + ", ".join(f"{k} {v:.6f}" for k, v in first.items()))
    base_loss = first["ours"]
    worst = max(abs(v - base_loss) / abs(base_loss) for v in first.values())
    print(f"max relative loss difference between sides: {worst:.1e} (same math)")
    print()
    head = f"{'side':<16}{'micro-batches':>14}{'tokens run':>12}{'step s':>9}{'tokens/s':>10}" \
           f"{'MFU fp32':>10}{'MFU bf16':>10}{'ours x':>8}"
    print(head)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    for name, side in sides.items():
        run = tokens if name == "ours" else side.padded_tokens
        print(f"{name:<16}{side.num_micro_batches:>14}{run:>12}{med[name]:>9.2f}{tokens / med[name]:>10.0f}"
              f"{flops / med[name] / peaks['fp32']:>10.1%}{flops / med[name] / peaks['bf16']:>10.1%}"
              f"{med[name] / med['ours']:>7.2f}x")
    print()
    safe_name = next(n for n in sides if n != "ours")
    ratio = med[safe_name] / med["ours"]  # tokens/s ratio: both sides run the same real tokens
    verdict = "met" if ratio >= 2.0 else "NOT met"
    print(f"tokens/s ours / {safe_name} (same peak memory): {ratio:.2f}x  (target >= 2x: {verdict})")
    runs = "; ".join(f"{k}: {', '.join(f'{x:.2f}' for x in v)}" for k, v in times.items())
    print(f"step times (s): {runs}")
    save_json(args.json, {
        "benchmark": "step_throughput", "device": str(device), "dtype": args.dtype, "tokens": tokens,
        "peak_flops": peaks, "step_flops": flops, "ratio_vs_safe": ratio, "safe_baseline": safe_name,
        "sides": {name: {"median_s": med[name], "tokens_per_s": tokens / med[name],
                         "mfu_fp32": flops / med[name] / peaks["fp32"],
                         "mfu_bf16": flops / med[name] / peaks["bf16"],
                         "micro_batches": side.num_micro_batches} for name, side in sides.items()},
    })


if __name__ == "__main__":
    main()
