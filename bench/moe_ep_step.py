"""Expert parallelism vs replicated experts: one training step of a Qwen3-MoE at dp=2, ep=2 against ep=1.

Two gloo ranks (127.0.0.1) build the same engine backend (``--strategy torchtitan`` or ``megatron``, each
in its own venv) twice on the same tiny-but-wider Qwen3-MoE: with every expert on both ranks (ep=1, the
dp=2 baseline) and with the experts split over the two ranks (``expert_model_parallel_size=2``). A step is
``train_batch`` of this rank's half of a fixed batch (an SFT token-mean loss, AdamW); the two sides
alternate within every repeat (the machine is shared and noisy), the first round is a warm-up. Printed:
the median step time of each side (the slower rank per step), the ratio ep=2 / ep=1 (``< 1``: EP is
faster) and the first step's losses, which must agree.

    .venv-torchtitan/bin/python bench/moe_ep_step.py --strategy torchtitan
    .venv-megatron/bin/python bench/moe_ep_step.py --strategy megatron
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", required=True, choices=["torchtitan", "megatron"])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--expert-hidden", type=int, default=512, help="moe_intermediate_size")
    p.add_argument("--samples", type=int, default=8, help="per rank")
    p.add_argument("--seq-len", type=int, default=128, help="longest sample (prompt + response)")
    p.add_argument("--repeats", type=int, default=5)
    return p.parse_args()


def _rank(strategy: str, path: str, samples: int, seq_len: int, repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    from tests.engine.common import random_batch
    from verl_trainer.core_algos.losses import SFTLossConfig, sft_loss
    from verl_trainer.engine import EngineConfig, EngineRegistry, OptimConfig

    torch.set_num_threads(1)
    rank = dist.get_rank()
    batch = random_batch(2 * samples, seed=0, max_prompt=seq_len // 4, max_response=seq_len - seq_len // 4)
    batch = batch[rank * samples:(rank + 1) * samples]
    loss_fn = sft_loss(SFTLossConfig(loss_agg_mode="token-mean"))
    optim = OptimConfig(lr=1e-5, weight_decay=0.0, clip_grad=1.0)
    engines = {}
    for ep in (1, 2):
        config = EngineConfig(model_path=path, micro_batch_size_per_gpu=samples,
                              expert_model_parallel_size=ep)
        engines[ep] = EngineRegistry.new("language_model", strategy, config, optim)
        engines[ep].initialize()
    times: dict[int, list[float]] = {1: [], 2: []}
    first: dict[int, float] = {}
    for _ in range(repeats + 1):
        for ep, engine in engines.items():
            dist.barrier()
            start = time.perf_counter()
            with engine.train_mode():
                out = engine.train_batch(batch, loss_fn)
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step lasts as long as its slower rank
            if ep not in first:
                first[ep] = float(out["loss"])
            else:
                times[ep].append(float(elapsed))
    return {"times": times, "first": first}


def main() -> None:
    args = parse_args()
    from verl_trainer.models.tiny import make_tiny_model
    from verl_trainer.testing.ranks import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(Path(tmp) / "moe", arch="qwen3_moe", hidden_size=args.hidden,
                               num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                               num_experts=args.experts, moe_intermediate_size=args.expert_hidden, seed=0)
        report = run_distributed(_rank, 2, args.strategy, path, args.samples, args.seq_len, args.repeats,
                                 timeout=1800)[0]
    median = {ep: statistics.median(t) for ep, t in report["times"].items()}
    print(f"{args.strategy}: Qwen3-MoE hidden {args.hidden} x {args.layers} layers, {args.experts} experts "
          f"(top-2, expert hidden {args.expert_hidden}), dp=2 on 2 gloo ranks, {args.samples} samples x <= "
          f"{args.seq_len} tokens per rank, {args.repeats} repeats, CPU fp32")
    print(f"{'side':24s} {'median step s':>14s} {'/ ep=1':>8s} {'first loss':>12s}")
    for ep, label in ((1, "ep=1 (replicated experts)"), (2, "ep=2")):
        print(f"{label:24s} {median[ep]:14.3f} {median[ep] / median[1]:8.2f} {report['first'][ep]:12.6f}")


if __name__ == "__main__":
    main()
