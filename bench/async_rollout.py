"""One-step-off asynchronous rollout (``algorithm.rollout.max_staleness=1``) vs the synchronous run.

    nice -n 10 python bench/async_rollout.py [--workload default,realistic] [--rounds 3] [--steps 20]
                                             [--devices 1] [--json F]

Runs ``recipes/grpo.py`` in paired rounds, each round one synchronous run (``max_staleness=0``) and one
one-step-off run (``max_staleness=1``), in alternating order, each in its own process from the same fresh
directory (same tiny model, data and seed; no warm start, validation, checkpoints or export). Both runs
have ``rollout_correction.level=token``, so the two sides differ only in the overlap. Workloads:

* ``default``: ``configs/grpo.yaml`` as it is (tiny Qwen2 hidden 64 / 2 layers, 32 prompts x 8, 4 new
  tokens, fsdp2);
* ``realistic``: ``bench/rollout.py``'s realistic shape (hidden 256 / 4 layers / 8 heads, 16 prompts x 8,
  up to 128 new tokens), where generation is most of a synchronous step.

Per run, the median over steps 3..N of ``timing/step_s`` (the whole RL step: generation or the wait for it,
rewards, update, weight copy), ``timing/rollout_s`` (generation of the trained batch, on the background
thread when one step off), ``timing/update_s`` and ``timing/idle_s`` (the training thread waiting for the
generation). Printed: per round the step-time ratio sync / async (> 1: one step off is faster), the median
over the rounds, and the overlap per step (generation, training, idle) of each side.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = {
    "default": (),
    "realistic": ("model.tiny.hidden_size=256", "model.tiny.num_hidden_layers=4",
                  "model.tiny.num_attention_heads=8", "model.tiny.num_key_value_heads=4",
                  "data.train_batch_size=16", "algorithm.actor.ppo_mini_batch_size=16",
                  "algorithm.rollout.max_new_tokens=128", "data.max_prompt_length=16"),
}
TIMINGS = ("step_s", "rollout_s", "update_s", "idle_s")


def run(workdir: Path, name: str, staleness: int, steps: int, devices: int,
        workload: tuple[str, ...]) -> dict:
    """One recipe run; the median of each timing over steps 3..N."""
    root = workdir / f"{name}_{staleness}"
    args = [sys.executable, str(ROOT / "recipes" / "grpo.py"), f"trainer.max_steps={steps}",
            f"trainer.devices={devices}", "trainer.val_check_interval=null", "trainer.logger=[csv]",
            "trainer.enable_checkpointing=false", "trainer.export_hf=false",
            "trainer.validate_before_fit=false", "trainer.enable_progress_bar=false",
            f"trainer.default_root_dir={root}", "warm_start.enable=false",
            f"algorithm.rollout.max_staleness={staleness}", "algorithm.rollout_correction.level=token",
            *workload]
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(args, cwd=workdir, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rows = [r for f in sorted(root.glob("**/metrics.csv")) for r in csv.DictReader(open(f))]
    rows = [r for r in rows if r.get("timing/step_s") and int(r["step"]) > 2]
    out = {k: statistics.median(float(r.get(f"timing/{k}") or "nan") for r in rows) for k in TIMINGS}
    out["staleness"] = statistics.mean(float(r.get("rollout/staleness") or 0.0) for r in rows)
    out["reward_mean"] = statistics.mean(float(r["reward/mean"]) for r in rows)
    return out


def bench(name: str, rounds: int, steps: int, devices: int) -> dict:
    workload = WORKLOADS[name]
    result: dict = {"rounds": []}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        run(workdir, "warmup", 0, 3, devices, workload)  # makes the tiny model and the task once
        for r in range(rounds):
            order = (0, 1) if r % 2 == 0 else (1, 0)
            sides = {s: run(workdir, f"round{r}", s, steps, devices, workload) for s in order}
            ratio = sides[0]["step_s"] / sides[1]["step_s"]
            result["rounds"].append({"sync": sides[0], "async": sides[1], "ratio": ratio})
            print(f"  {name} round {r + 1}: step sync {sides[0]['step_s'] * 1e3:.1f} ms, one step off "
                  f"{sides[1]['step_s'] * 1e3:.1f} ms -> {ratio:.2f}x", flush=True)
    result["ratio_median"] = statistics.median(x["ratio"] for x in result["rounds"])
    for side in ("sync", "async"):
        result[side] = {k: statistics.median(x[side][k] for x in result["rounds"]) for k in TIMINGS}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="default", help=f"comma-separated, of {sorted(WORKLOADS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = {}
    for name in args.workload.split(","):
        if name not in WORKLOADS:
            raise SystemExit(f"--workload {name!r}: choose from {sorted(WORKLOADS)}")
        res = results[name] = bench(name, args.rounds, args.steps, args.devices)
        print(f"{name}: sync / one-step-off step time, median of {args.rounds} paired rounds: "
              f"{res['ratio_median']:.2f}x (devices={args.devices}, steps 3..{args.steps})")
        for side in ("sync", "async"):
            t = res[side]
            idle = "" if side == "sync" else f", idle {t['idle_s'] * 1e3:.1f} ms"
            print(f"  {side:5s} per step: {t['step_s'] * 1e3:.1f} ms = generation "
                  f"{t['rollout_s'] * 1e3:.1f} ms"
                  f"{' (background)' if side == 'async' else ''}, update {t['update_s'] * 1e3:.1f} ms{idle}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
