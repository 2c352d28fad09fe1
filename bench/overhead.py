"""Trainer overhead: ``Trainer(strategy="fsdp2").fit(SFT(...))`` against a hand-written PyTorch loop.

Both sides train the same ~17M-parameter Llama from the same weights on the same batches (16 samples
per step, lognormal lengths in [20, 2048], data order fixed) with the same math: dynamic micro-batches
of at most ``--budget`` tokens, each packed into one row with padding-free attention, a token-mean loss
over the step's response tokens, AdamW, grad-norm clipping at 1.0. The hand loop uses torch plus the
same pure functions for the math (planner, packing, varlen attention) and nothing else; the Trainer
side adds what a user gets by default: the fsdp2 engine (``fully_shard`` on a 1-rank mesh, its
gradient-sync control and clipping), the resumable sharded loader, the callbacks (metric reduction,
progress bar), the CSV logger, the LR scheduler. Checkpointing is off (saving is not part of a step).

A step's time is the wall time from the start of one step (incl. fetching its batch) to the start of
the next, so logging and callbacks count. The first step of every run is a warm-up; the sides run in
alternating rounds and the median step time is compared. The per-step losses of the two sides must
agree (same math); the largest relative difference is printed.

Target: overhead <= 5%.

Usage: python bench/overhead.py [--steps 5] [--rounds 2] [--batch 16] [--budget 4096]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import init_single_process, random_pairs, sample_lengths, save_json, write_model  # noqa: E402

from verl_trainer import Trainer  # noqa: E402
from verl_trainer.algorithms.sft import SFT, SFTConfig
from verl_trainer.callbacks import Callback  # noqa: E402
from verl_trainer.data.packing import next_token_log_probs_and_entropy, pack_batch  # noqa: E402
from verl_trainer.data.sft import SFTDataset, collate_sft  # noqa: E402
from verl_trainer.engine import EngineConfig, OptimConfig  # noqa: E402
from verl_trainer.engine.micro_batch import prepare_micro_batches  # noqa: E402
from verl_trainer.models.attention import VARLEN_ATTENTION, packed_forward  # noqa: E402
from verl_trainer.models.loading import load_causal_lm  # noqa: E402

OPTIM = OptimConfig(lr=1e-4, weight_decay=0.0, clip_grad=1.0)


class StepClock(Callback):
    """Start time of every step (and the end of training); the reduced ``sft/loss`` of every step."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.losses: list[float] = []

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(trainer.callback_metrics["sft/loss"]))

    def on_train_end(self, trainer: Any, module: Any) -> None:
        self.starts.append(time.perf_counter())


def loader(dataset: SFTDataset, batch: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch, shuffle=False, collate_fn=collate_sft)


def run_trainer(path: str, dataset: SFTDataset, args: argparse.Namespace, root: str) -> tuple[list, list]:
    """Steps of ``Trainer.fit``: (step times without the warm-up, per-step losses)."""
    engine = EngineConfig(use_dynamic_bsz=True, max_token_len_per_gpu=args.budget)
    module = SFT(SFTConfig(model_path=path, engine=engine, optim=OPTIM))
    clock = StepClock()
    trainer = Trainer(strategy="fsdp2", accelerator="cpu", devices=1, max_steps=args.steps + 1,
                      callbacks=[clock], enable_checkpointing=False, default_root_dir=root)
    trainer.fit(module, loader(dataset, args.batch))
    times = [b - a for a, b in zip(clock.starts, clock.starts[1:])]
    return times[1:], clock.losses


def run_hand_loop(path: str, dataset: SFTDataset, args: argparse.Namespace) -> tuple[list, list]:
    """The same steps in plain PyTorch: (step times without the warm-up, per-step losses)."""
    torch.manual_seed(0)
    model = load_causal_lm(path, attn_implementation=VARLEN_ATTENTION)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps,
                            weight_decay=OPTIM.weight_decay)
    times, losses = [], []
    data = iter(loader(dataset, args.batch))
    for _ in range(args.steps + 1):
        t0 = time.perf_counter()
        batch = next(data)
        opt.zero_grad(set_to_none=True)
        num_tokens = batch["loss_mask"].sum()
        micro_batches, _ = prepare_micro_batches(batch, dp_group=None, use_dynamic_bsz=True,
                                                 max_token_len_per_gpu=args.budget)
        total = torch.zeros(())
        for mb in micro_batches:
            packed = pack_batch(mb, keys=())
            logits = packed_forward(model, packed).logits
            log_probs, _ = next_token_log_probs_and_entropy(logits, packed.input_ids, packed.cu_seqlens)
            loss = -(packed.unpack(log_probs) * mb["loss_mask"]).sum() / num_tokens
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.clip_grad)
        opt.step()
        losses.append(float(total))
        times.append(time.perf_counter() - t0)
    return times[1:], losses


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5, help="timed steps per run (after one warm-up step)")
    p.add_argument("--rounds", type=int, default=2, help="alternating runs of each side")
    p.add_argument("--batch", type=int, default=16, help="samples per step")
    p.add_argument("--median-len", type=float, default=128.0)
    p.add_argument("--budget", type=int, default=4096, help="max_token_len_per_gpu")
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--json", type=str, default=None, help="also write the results here (for plot_results.py)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    init_single_process(torch.device("cpu"))
    n = (args.steps + 1) * args.batch
    lens = sample_lengths(n, args.median_len, 1.0, seed=0, cap_one=False)
    dataset = SFTDataset(random_pairs(lens, args.vocab, seed=0))
    times: dict[str, list[float]] = {"hand loop": [], "Trainer": []}
    losses: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "model")
        write_model(path, args.hidden, args.layers, args.vocab)
        for r in range(args.rounds):
            t, losses["hand loop"] = run_hand_loop(path, dataset, args)
            times["hand loop"] += t
            t, losses["Trainer"] = run_trainer(path, dataset, args, str(Path(tmp) / f"run{r}"))
            times["Trainer"] += t
    tokens = sum(lens) / (args.steps + 1)
    print(f"\n{args.batch} samples per step (~{tokens:.0f} tokens), budget {args.budget}, "
          f"{args.steps} timed steps x {args.rounds} rounds per side, "
          f"torch threads {torch.get_num_threads()}")
    diff = max(abs(a - b) / abs(b) for a, b in zip(losses["Trainer"], losses["hand loop"]))
    print(f"per-step losses, Trainer vs hand loop: max relative difference {diff:.1e} (same math)")
    for name, ts in times.items():
        steps = ", ".join(f"{x:.2f}" for x in ts)
        print(f"{name:<10} median step {statistics.median(ts):.3f} s  (steps: {steps})")
    overhead = statistics.median(times["Trainer"]) / statistics.median(times["hand loop"]) - 1
    verdict = "met" if overhead <= 0.05 else "NOT met"
    print(f"Trainer overhead: {overhead:+.1%}  (target <= 5%: {verdict})")
    save_json(args.json, {"benchmark": "overhead", "overhead": overhead, "loss_max_rel_diff": diff,
                          "median_s": {k: statistics.median(v) for k, v in times.items()}, "steps": times})


if __name__ == "__main__":
    main()
