"""HF rollout vs the colocated vLLM engine, in the same run (the vllm venv: .venv-vllm).

    OMP_NUM_THREADS=1 .venv-vllm/bin/python bench/rollout.py [--shapes default,realistic,0.5b] [--json F]

For each shape: one model checkpoint (Qwen2, head size 32 or 64, which vLLM's CPU attention takes), one
``HFRollout`` (the default: drop-finished decoding on CPU) and one ``VLLMRollout``, both built once; then
per backend the median over ``--repeats`` calls of ``generate``, HF and vLLM calls interleaved (sampling
at temperature 1, per-request seeds: both draw different samples, so the response lengths are reported
with the times) and the weight
sync (HF: ``update_weights``, a copy; the trainer usually aliases instead, ``share_weights``; vLLM:
``update_weights`` = ``reload_weights`` + prefix-cache reset). Printed: ms per batch, ms per 1,000
response tokens, and the ratio HF / vLLM (> 1: vLLM faster).

``--grpo-steps N`` also runs ``recipes/grpo.py`` for N steps per backend (no warm start, no validation,
the shape's model, batch and response length) and reports the median ``timing/step_s`` and
``timing/rollout_s`` of steps 2..N.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench._common import save_json
from verl_trainer.data.tasks import ArithmeticTaskConfig, write_arithmetic_task
from verl_trainer.models import load_tokenizer, make_tiny_model
from verl_trainer.models.loading import load_causal_lm
from verl_trainer.rollout import RolloutConfig, build_rollout


@dataclass
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    prompts: int
    n: int
    max_new_tokens: int


SHAPES = {
    "default": Shape(64, 2, 2, 1, 32, 8, 4),  # the demo's (configs/grpo.yaml) at head size 32
    "realistic": Shape(256, 4, 8, 4, 16, 8, 128),
    # Qwen2.5-0.5B's layers (hidden 896, 24 layers, 14 / 2 heads of 64) with the character vocabulary
    # (make_tiny_model ties the vocabulary to its tokenizer: 151,936 rows are not made here), fewer sequences
    "0.5b": Shape(896, 24, 14, 2, 4, 4, 64),
    # between the realistic shape (3.1M decoder parameters) and 0.5B's layers (231M), where the `auto`
    # rule's CPU threshold lies: 12 * 6 * 384^2 = 11M, 12 * 8 * 512^2 = 25M and 12 * 12 * 768^2 = 85M
    # (GPT-2 small's layers)
    "11m": Shape(384, 6, 6, 2, 4, 4, 64),
    "25m": Shape(512, 8, 8, 2, 4, 4, 64),
    "85m": Shape(768, 12, 12, 2, 4, 4, 64),
}


def prompts(path: str, count: int) -> list[dict]:
    tok = load_tokenizer(path)
    return [{"input_ids": tok.encode(f"{i % 10}+{i % 7}=", add_special_tokens=False), "index": i}
            for i in range(count)]


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def bench_shape(name: str, shape: Shape, repeats: int, root: str) -> dict:
    path = make_tiny_model(os.path.join(root, name), hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                           num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                           max_position_embeddings=256, seed=0)
    items = prompts(path, shape.prompts)
    state = load_causal_lm(path).state_dict()
    result: dict = {"shape": vars(shape)}
    rollouts = {}
    for backend in ("hf", "vllm"):
        config = RolloutConfig(name=backend, n=shape.n, max_new_tokens=shape.max_new_tokens,
                               max_model_len=256)
        t0 = time.perf_counter()
        rollouts[backend] = build_rollout(config, path)
        result[backend] = {"build_s": time.perf_counter() - t0}
        rollouts[backend].generate(items)  # warm-up
    times: dict = {b: {"gen": [], "sync": []} for b in rollouts}
    for _ in range(repeats):  # interleaved, so load from other processes hits both alike
        for backend, rollout in rollouts.items():
            gen_s, batch = timed(lambda r=rollout: r.generate(items), 1)
            sync_s, _ = timed(lambda r=rollout: r.update_weights(state.items()), 1)
            times[backend]["gen"].append(gen_s)
            times[backend]["sync"].append(sync_s)
            result[backend]["tokens"] = int(batch["response_len"].sum())
    for backend in rollouts:
        gen_s = statistics.median(times[backend]["gen"])
        tokens = result[backend]["tokens"]
        result[backend].update(batch_ms=gen_s * 1e3, ms_per_1k_tokens=gen_s * 1e3 / tokens * 1000,
                               sync_ms=statistics.median(times[backend]["sync"]) * 1e3)
    result["ratio_batch"] = result["hf"]["batch_ms"] / result["vllm"]["batch_ms"]
    result["ratio_per_token"] = result["hf"]["ms_per_1k_tokens"] / result["vllm"]["ms_per_1k_tokens"]
    return result


def grpo_steps(shape: Shape, model: str, steps: int, root: str) -> dict:
    """Median GRPO step and rollout seconds (steps 2..N) of the recipe with each backend."""
    data = os.path.join(root, "task")
    write_arithmetic_task(data, ArithmeticTaskConfig(num_train=256, num_val=4, holdout_fraction=0.2))
    out = {}
    for backend in ("hf", "vllm"):
        run = os.path.join(root, f"grpo_{backend}")
        args = [sys.executable, str(Path(__file__).resolve().parents[1] / "recipes" / "grpo.py"),
                f"algorithm.rollout.name={backend}", f"model.path={model}",
                "model.make_tiny_if_missing=false",
                f"task.dir={data}", "task.write_if_missing=false", "warm_start.enable=false",
                f"trainer.max_steps={steps}", "trainer.val_check_interval=null", "trainer.logger=[csv]",
                "trainer.enable_checkpointing=false", f"trainer.default_root_dir={run}",
                f"data.train_batch_size={shape.prompts}", f"algorithm.rollout.n={shape.n}",
                f"algorithm.rollout.max_new_tokens={shape.max_new_tokens}",
                "algorithm.rollout.max_model_len=256",
                f"algorithm.actor.ppo_mini_batch_size={shape.prompts}", "trainer.enable_progress_bar=false"]
        subprocess.run(args, check=True, capture_output=True, env={**os.environ, "WANDB_MODE": "offline"})
        rows = [r for f in Path(run).glob("**/metrics.csv") for r in csv.DictReader(open(f))]
        timed_rows = [r for r in rows if r.get("timing/step_s") and int(r["step"]) > 1]
        out[backend] = {k: statistics.median(float(r[f"timing/{k}"]) for r in timed_rows)
                        for k in ("step_s", "rollout_s")}
    out["ratio_step"] = out["hf"]["step_s"] / out["vllm"]["step_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="default,realistic")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--grpo-steps", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(0)
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for name in args.shapes.split(","):
            r = results[name] = bench_shape(name, SHAPES[name], args.repeats, root)
            hf, vl = r["hf"], r["vllm"]
            print(f"{name:10s} HF {hf['batch_ms']:8.1f} ms/batch {hf['ms_per_1k_tokens']:8.1f} ms/1k tok "
                  f"({hf['tokens']} tok) sync {hf['sync_ms']:6.1f} ms | vLLM {vl['batch_ms']:8.1f} ms/batch "
                  f"{vl['ms_per_1k_tokens']:8.1f} ms/1k tok ({vl['tokens']} tok) "
                  f"sync {vl['sync_ms']:6.1f} ms "
                  f"build {vl['build_s']:.1f} s | HF/vLLM {r['ratio_batch']:.2f}x per batch, "
                  f"{r['ratio_per_token']:.2f}x per token", flush=True)
            if args.grpo_steps:
                g = r["grpo"] = grpo_steps(SHAPES[name], os.path.join(root, name), args.grpo_steps, root)
                print(f"{name:10s} GRPO step HF {g['hf']['step_s']:.2f} s "
                      f"(rollout {g['hf']['rollout_s']:.2f}) | "
                      f"vLLM {g['vllm']['step_s']:.2f} s (rollout {g['vllm']['rollout_s']:.2f}) | HF/vLLM "
                      f"{g['ratio_step']:.2f}x", flush=True)
    save_json(args.json, results)


if __name__ == "__main__":
    main()
