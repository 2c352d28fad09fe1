"""Asynchronous rollout (``algorithm.rollout.max_staleness=k``) vs the synchronous run.

    nice -n 10 python bench/async_rollout.py [--workload default,realistic,long_tail]
                                             [--staleness 1,2,4,2p,2d] [--rounds 3] [--steps 20]
                                             [--devices 1] [--json F]

Runs ``recipes/grpo.py`` in paired rounds, each round one synchronous run (``max_staleness=0``) and one
run per ``k`` of ``--staleness`` (``2p``: ``k = 2`` with ``partial_rollout``; ``2d``, long_tail only:
``k = 2`` with the discarding baseline instead of admission control; ``0s``, ``2s``: ``k`` with a separate
rollout pool, ``placement=separate``, one rollout rank beside the ``--devices`` trainer ranks, so one process
more than the colocated sides), in an order rotated every round, each in its own process from the same
fresh directory (same tiny model, data and seed; no warm start, validation, checkpoints or export). All
runs have ``rollout_correction.level=token``, so the sides
differ only in the overlap. Workloads:

* ``default``: ``configs/grpo.yaml`` as it is (tiny Qwen2 hidden 64 / 2 layers, 32 prompts x 8, 4 new
  tokens, fsdp2);
* ``realistic``: ``bench/rollout.py``'s realistic shape (hidden 256 / 4 layers / 8 heads, 16 prompts x 8,
  up to 128 new tokens), where generation is most of a synchronous step;
* ``long_tail``: the realistic shape whose responses are capped at 16 tokens except for ~10% of the prompts,
  which generate up to 128 (8x longer; ``bench/long_tail_rollout.py``; the cap is per response, also across
  partial rollouts' chunks). Its ``d`` sides discard instead of admitting: generation stops at 16 tokens
  and the responses not finished by then (the long prompts') are dropped from training
  (``DiscardingLongTailRollout``, a bench-only baseline: the trainer never discards).

Per run, the median over steps 3..N of ``timing/step_s`` (the whole RL step: generation or the wait for it,
rewards, update, weight copy), ``timing/rollout_s`` (generation of the trained batch, on the background
thread when one step off), ``timing/update_s`` and ``timing/idle_s`` (the training thread waiting for the
generation). Printed: per round the step-time ratio sync / async_k (> 1: async is faster), the median over
the rounds, the overlap per step (generation, training, idle) of each side, and the trained response
length (mean over steps of ``response_length/mean`` and ``/max``): admission control trains every group it
admitted, so the length distribution stays that of the synchronous run (a scheme that discards slow groups
would shift it to the short ones; the ``d`` sides show by how much). The load average before and after
the runs is printed: on a shared machine the ratios are "under load".
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
WORKLOADS["long_tail"] = (*WORKLOADS["realistic"],
                          f"algorithm.rollout.name={ROOT / 'bench' / 'long_tail_rollout.py'}:LongTailRollout")
TIMINGS = ("step_s", "rollout_s", "update_s", "idle_s")


def run(workdir: Path, name: str, side: str, steps: int, devices: int,
        workload: tuple[str, ...]) -> dict:
    """One recipe run (``side``: ``"k"``; ``"kp"`` with partial rollouts; ``"ks"`` with a separate pool); the
    medians over steps 3..N."""
    root = workdir / f"{name}_{side}"
    staleness = int(side.rstrip("pds"))
    partial, discard, separate = side.endswith("p"), side.endswith("d"), side.endswith("s")
    if discard:  # the bench-only baseline: the long responses cut at the deadline and dropped
        workload = (*workload, f"algorithm.rollout.name={ROOT / 'bench' / 'long_tail_rollout.py'}"
                               ":DiscardingLongTailRollout")
    pool = ("algorithm.rollout.placement=separate", "algorithm.rollout.rollout_ranks=1") if separate else ()
    args = [sys.executable, str(ROOT / "recipes" / "grpo.py"), f"trainer.max_steps={steps}",
            f"trainer.devices={devices + int(separate)}", *pool,
            "trainer.val_check_interval=null", "trainer.logger=[csv]",
            "trainer.enable_checkpointing=false", "trainer.export_hf=false",
            "trainer.validate_before_fit=false", "trainer.enable_progress_bar=false",
            f"trainer.default_root_dir={root}", "warm_start.enable=false",
            f"algorithm.rollout.max_staleness={staleness}", "algorithm.rollout_correction.level=token",
            f"algorithm.rollout.partial_rollout={str(partial).lower()}", *workload]
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(args, cwd=workdir, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rows = [r for f in sorted(root.glob("**/metrics.csv")) for r in csv.DictReader(open(f))]
    rows = [r for r in rows if r.get("timing/step_s") and int(r["step"]) > 2]
    out = {k: statistics.median(float(r.get(f"timing/{k}") or "nan") for r in rows) for k in TIMINGS}
    out["staleness"] = statistics.mean(float(r.get("rollout/staleness") or 0.0) for r in rows)
    out["reward_mean"] = statistics.mean(float(r["reward/mean"]) for r in rows)
    out["length_mean"] = statistics.mean(float(r["response_length/mean"]) for r in rows)
    out["length_max"] = statistics.mean(float(r["response_length/max"]) for r in rows)
    out["long_share"] = statistics.mean(float(r["response_length/clip_ratio"]) for r in rows)
    tokens = [sum(float(r.get(f"rollout/tokens_at_staleness_{d}") or 0.0) for r in rows)
              for d in range(staleness + 1)]
    out["token_staleness"] = (sum(d * t for d, t in enumerate(tokens)) / sum(tokens)) if sum(tokens) else 0.0
    return out


def bench(name: str, staleness: list[str], rounds: int, steps: int, devices: int) -> dict:
    workload, sides = WORKLOADS[name], ["0", *staleness]
    if name != "long_tail":  # the discarding baseline is the long-tailed workload's
        staleness = [k for k in staleness if not k.endswith("d")]
        sides = ["0", *staleness]
    result: dict = {"rounds": []}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        run(workdir, "warmup", "0", 3, devices, workload)  # makes the tiny model and the task once
        for r in range(rounds):
            order = sides[r % len(sides):] + sides[: r % len(sides)]
            got = {k: run(workdir, f"round{r}", k, steps, devices, workload) for k in order}
            ratios = {k: got["0"]["step_s"] / got[k]["step_s"] for k in staleness}
            result["rounds"].append({"sides": got, "ratio": ratios})
            print(f"  {name} round {r + 1}: step sync {got['0']['step_s'] * 1e3:.1f} ms; " + ", ".join(
                f"k={k} {got[k]['step_s'] * 1e3:.1f} ms -> {ratios[k]:.2f}x" for k in staleness), flush=True)
    result["ratio_median"] = {k: statistics.median(x["ratio"][k] for x in result["rounds"])
                              for k in staleness}
    keys = (*TIMINGS, "length_mean", "length_max", "long_share", "staleness", "token_staleness")
    result["sides"] = {k: {t: statistics.median(x["sides"][k][t] for x in result["rounds"]) for t in keys}
                       for k in sides}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="default", help=f"comma-separated, of {sorted(WORKLOADS)}")
    parser.add_argument("--staleness", default="1,2,4,2p",
                        help="comma-separated k >= 1 to compare with k=0; 'kp': k with partial rollouts; "
                             "'ks': k >= 0 with a separate rollout pool (one more process)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    staleness = args.staleness.split(",")
    results: dict = {"load_before": os.getloadavg()}
    print(f"load average before: {results['load_before']}", flush=True)
    for name in args.workload.split(","):
        if name not in WORKLOADS:
            raise SystemExit(f"--workload {name!r}: choose from {sorted(WORKLOADS)}")
        res = results[name] = bench(name, staleness, args.rounds, args.steps, args.devices)
        ratios = ", ".join(f"k={k} {res['ratio_median'][k]:.2f}x" for k in staleness)
        print(f"{name}: sync / async step time, median of {args.rounds} paired rounds "
              f"(devices={args.devices}, steps 3..{args.steps}): {ratios}")
        for k, t in res["sides"].items():
            idle = "" if k == "0" else f", idle {t['idle_s'] * 1e3:.1f} ms"
            print(f"  k={k} per step: {t['step_s'] * 1e3:.1f} ms = generation {t['rollout_s'] * 1e3:.1f} ms"
                  f"{' (background)' if k != '0' else ''}, update {t['update_s'] * 1e3:.1f} ms{idle}; "
                  f"trained length mean {t['length_mean']:.1f} max {t['length_max']:.1f} "
                  f"(share at max_new_tokens {t['long_share']:.3f}), "
                  f"staleness {t['staleness']:.2f} (per token {t['token_staleness']:.2f})")
    results["load_after"] = os.getloadavg()
    print(f"load average after: {results['load_after']} (above ~2 on 2 cores: the ratios are under load)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
