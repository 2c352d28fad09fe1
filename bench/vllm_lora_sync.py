"""LoRA weight sync to vLLM: adapter-only (``rollout.lora_sync=adapter``) vs the merged full sync.

    OMP_NUM_THREADS=1 .venv-vllm/bin/python bench/vllm_lora_sync.py [--hidden 512] [--layers 4] [--rank 16]
                                                                    [--rounds 3] [--tokens 32]

One process: a tiny Qwen2 (head size 64), an fsdp2 LoRA actor (all-linear) and one vLLM engine built with
``enable_lora``. Per round, in one order: the merged sync (``WeightSync`` with ``lora_sync=merged``: every
base tensor with the adapters merged, streamed into ``reload_weights``) and the adapter sync (the adapters
alone written as a new LoRA version), then greedy generation of 16 prompts x ``--tokens`` tokens with the
merged weights (no LoRA request) and with the adapter (a LoRA request on the base weights). Printed: the
median over rounds of each, the ratios merged / adapter (> 1: the adapter side is faster) and the bytes
each sync moves. A ratio of this run only; sizes and machine change it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()

    import torch

    from verl_trainer.algorithms.stages.rollout import WeightSync
    from verl_trainer.engine import EngineConfig, EngineRegistry, OptimConfig
    from verl_trainer.models import make_tiny_model
    from verl_trainer.models.loading import load_causal_lm
    from verl_trainer.rollout import RolloutConfig, build_rollout
    from verl_trainer.rollout.vllm_support import model_config

    root = Path(tempfile.mkdtemp(prefix="bench_vllm_lora_"))
    heads = args.hidden // 64
    path = make_tiny_model(root / "model", hidden_size=args.hidden, num_hidden_layers=args.layers,
                           num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                           intermediate_size=4 * args.hidden, max_position_embeddings=256, seed=0)
    settings = dict(name="vllm", n=1, max_new_tokens=args.tokens, max_model_len=128, max_lora_rank=args.rank)
    rollout = build_rollout(RolloutConfig(**settings, lora_sync="adapter"), path)
    engine = EngineRegistry.new("language_model", "fsdp2", EngineConfig(
        model_path=path, lora_rank=args.rank, lora_alpha=2 * args.rank), OptimConfig(lr=1e-3))
    engine.initialize()
    with torch.no_grad():  # a trained-looking adapter: B non-zero
        for name, p in engine.peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    adapter = WeightSync(engine, rollout, RolloutConfig(**settings, lora_sync="adapter"))
    merged = WeightSync(engine, rollout, RolloutConfig(**settings, lora_sync="merged"))
    base = load_causal_lm(path).state_dict()
    g = torch.Generator().manual_seed(0)
    vocab = model_config(path)["vocab_size"]
    items = [{"input_ids": torch.randint(4, vocab, (12,), generator=g).tolist(), "index": i}
             for i in range(16)]
    keys = ("sync merged", "sync adapter", "gen merged", "gen adapter")
    times: dict[str, list[float]] = {k: [] for k in keys}

    def timed(key, fn):
        start = time.perf_counter()
        out = fn()
        times[key].append(time.perf_counter() - start)
        return out

    for _ in range(args.rounds):
        rollout.update_weights(base.items())
        timed("sync adapter", adapter.sync)
        got = timed("gen adapter", lambda: rollout.generate(items, do_sample=False))
        active, rollout.adapters.active = rollout.adapters.active, None
        timed("sync merged", merged.sync)
        want = timed("gen merged", lambda: rollout.generate(items, do_sample=False))
        rollout.adapters.active = active
        assert torch.equal(got["input_ids"], want["input_ids"])
    size = lambda stream: sum(t.numel() * t.element_size() for _, t in stream)  # noqa: E731
    adapter_bytes = size(engine.get_per_tensor_param(adapters_only=True))
    merged_bytes = size(engine.get_per_tensor_param())
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model hidden {args.hidden} x {args.layers} layers, LoRA rank {args.rank}, {args.rounds} rounds")
    for key, value in med.items():
        print(f"  {key:14s} {value * 1000:9.1f} ms (median)")
    print(f"  sync bytes     merged {merged_bytes / 2**20:.1f} MiB, adapter {adapter_bytes / 2**20:.2f} MiB")
    print(f"ratio sync  merged / adapter: {med['sync merged'] / med['sync adapter']:.2f}x")
    print(f"ratio generation merged / adapter: {med['gen merged'] / med['gen adapter']:.2f}x "
          "(< 1: serving the LoRA request costs per token)")


if __name__ == "__main__":
    main()
