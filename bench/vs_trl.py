"""GRPO step time: our Trainer against TRL's GRPOTrainer on the same tiny model, prompts and reward.

Both sides train a randomly initialised Qwen2 (``--hidden``, ``--layers``, heads of 64, half as many
KV heads; made with ``make_tiny_model``) with GRPO on the arithmetic task's prompts (``"a+b="``), our
registered ``math`` reward (TRL gets it wrapped: completion text -> score), ``--n`` samples per prompt,
``--prompts`` prompts per step, ``--max-new-tokens``, temperature 1 (top-p 1, no top-k), eos = the
tokenizer's eos on both sides, fp32, AdamW ``--lr`` (default 1e-6, verl's actor default) constant, no
weight decay, grad clip 1.0, no KL / reference model, group mean/std advantages, token-mean loss over
the step (TRL ``loss_type="dapo"``), clip 0.2, one optimizer step per generation batch, the whole step
in one micro-batch, one process and ``--threads`` torch threads per side (default 1: with other work
on the machine, more OpenMP threads than free cores slow both sides several-fold, ours more).

**Equal length distributions.** Both sides sample with the same settings from the same weights (token
for token the same samples from the same seed). At a large lr a few lucky rewards move this random
policy within a few steps, in a direction set by which responses were drawn, so the two sides' lengths
would drift apart by chance; at the default lr 1e-6 the policy stays where it started and both sides
sample the same length distribution every step (the work of a step does not depend on the lr). The
script prints both sides' per-sample length histograms, means and the
two-sample Kolmogorov-Smirnov distance with its 5% critical value.

Each side runs in its own subprocess, the sides alternating (ours, trl, ours, trl, ...: ``--rounds``
pairs) so the machine's load hits both alike; each run warms up ``--warmup`` steps, then times
``--steps``. Medians over all timed steps of all rounds, per step (and per response token: the step's
time over its response tokens):
  * step: wall time between the ends of consecutive steps (all each loop does: data, metrics, logging);
  * generation: ours ``timing/rollout_s`` (sampling on the rollout copy, decode, batch; on CPU the
    loop that drops finished rows, ``RolloutConfig.decoding``);
    TRL ``GRPOTrainer._generate`` (tokenise, HF ``generate`` on the policy, cut at eos);
  * scoring: reward + group advantages (ours ``step_s - rollout_s - update_s``; TRL
    ``_generate_and_score_completions`` minus ``_generate``, decoding included);
  * update: step - generation - scoring, the same definition on both sides (ours: old log-probs,
    forward/backward, optimizer, weight sync (here a no-op: the rollout shares the weights); TRL:
    forward/backward, optimizer; each plus its loop's per-step overhead). Ours' ``timing/update_s``
    (no loop overhead) is shown too.

Target: TRL step / our step >= 1.5 where response lengths vary; no slower at equal lengths.

TRL is not a dependency of this project. Install it without letting pip touch torch:
``pip install datasets && pip install --no-deps trl`` (trl 1.16.0 needs accelerate, datasets, transformers,
pandas, all present then). Without it the script says so and exits 0.

Usage: python bench/vs_trl.py [--steps 8] [--warmup 2] [--rounds 2] [--prompts 32] [--n 8]
                              [--hidden 256] [--layers 4] [--max-new-tokens 8] [--threads 1] [--lr 1e-6]
                              [--decoding auto]
Variable lengths: python bench/vs_trl.py --max-new-tokens 128 --prompts 16 --n 8
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGETS = {"variable": 1.5, "equal": 1.0}
"""trl step / our step: >= 1.5x where response lengths vary, no slower at equal lengths."""
EQUAL_LENGTH_MAX_NEW_TOKENS = 8
"""The equal-length workload's cap (the default): nearly every response reaches it."""
SEED = 0
PHASES = ("step", "generation", "scoring", "update")
TIMED = ("rollout", "update", "step")
RUN_FLAGS = ("steps", "warmup", "prompts", "n", "hidden", "layers", "max_new_tokens", "threads", "lr",
             "decoding")
BIN = 16
DIFFERENCES = """\
What each side computes differently (the model, prompts, reward, n, lengths, batch and optimizer match):
  * Old log-probs: with one optimizer update per step both sides skip the extra no-grad forward and
    use the update's own detached log-probs (ours: actor.reuse_log_probs_on_policy, on by default;
    TRL: num_iterations=1 and steps_per_generation = gradient_accumulation_steps). With several
    updates per step both recompute them (ours as verl does).
  * Rollout: ours samples with an eval-mode model whose parameters are the actor's own tensors (one
    fsdp2 rank: RolloutConfig.share_weights, no copy or sync); TRL generates with the policy itself.
    Ours (on CPU) drops finished
    rows from the batch and the KV cache as they pile up; HF generate (TRL) runs every row through
    every step until the last one stops. Same warpers, same eos, same random draws while no row
    is dropped.
  * Padding: ours packs the samples into one row without padding (position ids per sample) and, on
    CPU, runs one call per group of equal-length samples per layer (batched matmuls up to the
    layout's measured crossover, SDPA beyond: verl_trainer.models.attention_autotune); TRL forwards the
    [B, P + C] batch, prompts left- and completions right-padded, with one masked SDPA per layer.
  * LM head: both project only the completion positions (TRL: a fused, tiled head that also returns
    entropy; ours: response positions, chunked log-softmax, no entropy unless calculate_entropy).
  * Optimizer: both AdamW, clip_grad_norm_ at 1.0; TRL (HF Trainer) uses the fused AdamW kernel
    (adamw_torch_fused); ours the multi-tensor one (foreach=True) on FSDP2's DTensor parameters.
  * Activation checkpointing: TRL's GRPOConfig turns it on by default; it is off here, as in ours
    (on, TRL's backward recomputes the forward: its update is ~25% slower).
  * Wrapping: ours runs the model under FSDP2 (one rank: hooks, DTensor parameters); TRL through
    accelerate without a wrapper.
  * Metrics: TRL computes entropy, clip ratios, reward and length statistics every step and logs
    them (logging_steps=1); ours reduces its declared metrics and logs nothing (logger=False).
  * Loss: the same token-mean over the step's response tokens (TRL dapo normalises by
    num_items_in_batch of the generation batch); advantages (r - mean) / (std + eps), eps 1e-4 in TRL
    and 1e-6 in ours.
  * Sampling: each side is seeded, but their random streams differ, so responses differ sample by
    sample; the length distributions are the same (histograms and the KS distance above)."""


# ------------------------------------------------------------------------------------------ setup
def prepare(workdir: Path, hidden: int, layers: int) -> None:
    """Write the tiny model (``workdir/model``) and the arithmetic task (``workdir/task``)."""
    from verl_trainer.data.tasks import ArithmeticTaskConfig, write_arithmetic_task
    from verl_trainer.models.tiny import make_tiny_model

    heads = max(1, hidden // 64)
    make_tiny_model(workdir / "model", hidden_size=hidden, num_hidden_layers=layers,
                    num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), seed=SEED)
    write_arithmetic_task(workdir / "task", ArithmeticTaskConfig(num_train=2000, num_val=10, seed=SEED))


# ------------------------------------------------------------------------------------------ our side
def our_config(args: argparse.Namespace, model: str) -> Any:
    """Our GRPOConfig for the benchmark's settings (one mini-batch, one micro-batch per step)."""
    from verl_trainer.algorithms.config import ActorConfig, GRPOConfig, RewardConfig
    from verl_trainer.core_algos.losses import PPOLossConfig
    from verl_trainer.engine.config import EngineConfig, OptimConfig
    from verl_trainer.rollout.config import RolloutConfig

    return GRPOConfig(
        model_path=model,
        actor=ActorConfig(
            engine=EngineConfig(micro_batch_size_per_gpu=args.prompts * args.n, seed=SEED),
            optim=OptimConfig(lr=args.lr, weight_decay=0.0, clip_grad=1.0, lr_scheduler="constant"),
            loss=PPOLossConfig(clip_ratio=0.2, loss_agg_mode="token-mean", use_kl_loss=False),
            ppo_mini_batch_size=args.prompts,
            ppo_epochs=1,
        ),
        rollout=RolloutConfig(n=args.n, max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=1.0,
                              top_k=-1, seed=SEED, decoding=args.decoding),
        reward=RewardConfig(name="math"),
        norm_adv_by_std_in_grpo=True,
    )


def run_ours(args: argparse.Namespace, model: str, train_file: str) -> list[dict[str, float]]:
    """``--warmup + --steps`` GRPO steps with our Trainer; the timings of the timed steps."""
    from verl_trainer.algorithms import GRPO, PromptDataModule
    from verl_trainer.algorithms.data import DataConfig
    from verl_trainer.callbacks import Callback
    from verl_trainer.models.loading import load_tokenizer
    from verl_trainer.trainer import Trainer

    rows: list[dict[str, Any]] = []

    class StepTimes(Callback):
        last_end: float | None = None
        lengths: list[int] = []

        def on_rollout_end(self, trainer: Any, module: Any, batch: Any) -> None:
            self.lengths = [int(x) for x in batch["response_len"].tolist()]

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, idx: int) -> None:
            now = time.perf_counter()
            if self.last_end is not None:
                rollout, update, step = (float(outputs[f"timing/{k}_s"]) for k in TIMED)
                rows.append({"step": now - self.last_end, "generation": rollout,
                             "scoring": step - rollout - update, "update_s": update,
                             "lengths": self.lengths})
            self.last_end = now

    data = PromptDataModule(DataConfig(train_files=train_file, train_batch_size=args.prompts,
                                       max_prompt_length=16), load_tokenizer(model))
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(strategy="fsdp2", accelerator="cpu", devices=1, max_steps=args.warmup + args.steps,
                          logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          default_root_dir=root, callbacks=[StepTimes()], seed=SEED)
        trainer.fit(GRPO(our_config(args, model)), datamodule=data)
    return rows[args.warmup - 1:]  # rows[i] is step i + 1: step 0 has no previous end


# ------------------------------------------------------------------------------------------ TRL side
def math_reward_for_trl() -> Any:
    """Our registered ``math`` reward as a TRL reward function (TRL passes dataset columns as kwargs)."""
    from verl_trainer.rewards import get_reward_fn

    score = get_reward_fn("math")

    def math_reward(prompts: list[str], completions: list[str], ground_truth: list[str],
                    data_source: list[str], **kwargs: Any) -> list[float]:
        results = (score(src, text, gt) for src, text, gt in zip(data_source, completions, ground_truth))
        return [float(r["score"] if isinstance(r, dict) else r) for r in results]

    return math_reward


def trl_dataset(train_file: str) -> Any:
    """The task's rows as a ``datasets.Dataset``: ``prompt``, ``ground_truth``, ``data_source``."""
    import datasets

    rows = [json.loads(line) for line in Path(train_file).read_text().splitlines() if line.strip()]
    return datasets.Dataset.from_dict({
        "prompt": [r["prompt"] for r in rows],
        "ground_truth": [r["reward_model"]["ground_truth"] for r in rows],
        "data_source": [r["data_source"] for r in rows],
    })


def trl_config(args: argparse.Namespace, out_dir: str) -> Any:
    """TRL's GRPOConfig matching :func:`our_config` (``per_device_train_batch_size`` counts completions)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, gradient_checkpointing=False, seed=SEED, data_seed=SEED,
        max_steps=args.warmup + args.steps, learning_rate=args.lr, lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=1.0, warmup_steps=0,
        per_device_train_batch_size=args.prompts * args.n, gradient_accumulation_steps=1,
        num_generations=args.n, num_iterations=1, max_completion_length=args.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, epsilon=0.2, loss_type="dapo",
        scale_rewards="group",
    )


def run_trl(args: argparse.Namespace, model: str, train_file: str) -> list[dict[str, float]]:
    """``--warmup + --steps`` steps of TRL's GRPOTrainer; the timings of the timed steps."""
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from verl_trainer.models.loading import load_causal_lm, load_tokenizer

    spent: dict[str, Any] = {"generation": 0.0, "generate_and_score": 0.0, "lengths": []}

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate(self, *a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            out = super()._generate(*a, **kw)
            spent["generation"] += time.perf_counter() - t0
            spent["lengths"] = spent["lengths"] + [len(ids) for ids in out[1]]  # completion ids, eos kept
            return out

        def _generate_and_score_completions(self, *a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(*a, **kw)
            spent["generate_and_score"] += time.perf_counter() - t0
            return out

    rows: list[dict[str, Any]] = []

    class StepTimes(TrainerCallback):
        last_end: float | None = None

        def on_step_end(self, *a: Any, **kw: Any) -> None:
            now = time.perf_counter()
            if self.last_end is not None:
                gen, gen_score = spent["generation"], spent["generate_and_score"]
                rows.append({"step": now - self.last_end, "generation": gen, "scoring": gen_score - gen,
                             "lengths": spent["lengths"]})
            self.last_end = now
            spent.update(generation=0.0, generate_and_score=0.0, lengths=[])

    with tempfile.TemporaryDirectory() as out_dir:
        trainer = TimedGRPOTrainer(
            model=load_causal_lm(model), reward_funcs=[math_reward_for_trl()], args=trl_config(args, out_dir),
            train_dataset=trl_dataset(train_file), processing_class=load_tokenizer(model),
            callbacks=[StepTimes()],
        )
        trainer.train()
    return rows[args.warmup - 1:]


# ------------------------------------------------------------------------------------------ driver
def run_side(side: str, args: argparse.Namespace, workdir: Path) -> list[dict[str, float]]:
    """One run of ``side`` in a fresh subprocess; its per-step rows."""
    cmd = [sys.executable, __file__, "--side", side, "--workdir", str(workdir)]
    for flag in RUN_FLAGS:
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    env = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ROWS ")]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"the {side} run failed (exit {proc.returncode})")
    return json.loads(lines[-1][len("ROWS "):])


def medians(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Median of every timing column, of ``update`` = step - generation - scoring, and per token."""
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "lengths"}
    med["update"] = statistics.median(r["step"] - r["generation"] - r["scoring"] for r in rows)
    med["step_per_token"] = statistics.median(r["step"] / max(1, sum(r["lengths"])) for r in rows)
    med["response_len"] = statistics.mean(x for r in rows for x in r["lengths"])
    return med


def ks_distance(a: list[int], b: list[int]) -> float:
    """Two-sample Kolmogorov-Smirnov distance: the largest gap between the empirical CDFs."""
    values = sorted(set(a) | set(b))
    sa, sb = sorted(a), sorted(b)
    cdf = lambda s, v: bisect.bisect_right(s, v) / len(s)  # noqa: E731
    return max(abs(cdf(sa, v) - cdf(sb, v)) for v in values)


def print_lengths(ours: list[int], trl: list[int], max_new: int) -> dict[str, float]:
    """Both sides' response-length histograms (bins of BIN tokens; ``max_new`` alone: cut), means, KS."""
    print(f"response lengths, all timed steps ({len(ours)} ours / {len(trl)} trl samples): fraction per bin")
    print(f"{'tokens':<12}{'ours':>8}{'trl':>8}")
    edges = [(lo, min(lo + BIN - 1, max_new - 1)) for lo in range(1, max_new, BIN)] + [(max_new, max_new)]
    for lo, hi in edges:
        label = f"{lo}" if lo == hi else f"{lo}-{hi}"
        fo = sum(lo <= x <= hi for x in ours) / len(ours)
        ft = sum(lo <= x <= hi for x in trl) / len(trl)
        print(f"{label:<12}{fo:>8.3f}{ft:>8.3f}")
    ks = ks_distance(ours, trl)
    critical = 1.36 * math.sqrt((len(ours) + len(trl)) / (len(ours) * len(trl)))
    same = "same distribution (not rejected at 5%)" if ks <= critical else "DIFFERENT distributions"
    mo, mt = statistics.mean(ours), statistics.mean(trl)
    print(f"mean {mo:.2f} (ours) / {mt:.2f} (trl); KS distance {ks:.3f}, 5% critical value {critical:.3f}: "
          f"{same}\n")
    return {"mean_ours": mo, "mean_trl": mt, "ks": ks, "ks_critical": critical}


def report(args: argparse.Namespace, ours: list[dict[str, Any]], trl: list[dict[str, Any]]) -> dict:
    """Print the comparison; return the results for ``--json``."""
    import torch
    import trl as trl_pkg

    o, t = medians(ours), medians(trl)
    print(f"\nGRPO, Qwen2 hidden {args.hidden} x {args.layers} layers, {args.prompts} prompts x n={args.n}, "
          f"max_new_tokens {args.max_new_tokens}, lr {args.lr:g}, fp32 CPU, {args.threads} thread(s) "
          f"per side; trl {trl_pkg.__version__}, torch {torch.__version__}; our decoding: {args.decoding}")
    print(f"medians over {len(ours)} (ours) / {len(trl)} (trl) timed steps of {args.rounds} alternating "
          "rounds\n")
    lengths = print_lengths([x for r in ours for x in r["lengths"]], [x for r in trl for x in r["lengths"]],
                            args.max_new_tokens)
    print(f"{'phase':<12}{'ours (s)':>10}{'trl (s)':>10}{'trl/ours':>10}")
    for phase in PHASES:
        print(f"{phase:<12}{o[phase]:>10.3f}{t[phase]:>10.3f}{t[phase] / o[phase]:>9.2f}x")
    print(f"{'update_s':<12}{o['update_s']:>10.3f}{t['update']:>10.3f}{t['update'] / o['update_s']:>9.2f}x"
          "   (ours: timing/update_s, without loop overhead)")
    per_token = t["step_per_token"] / o["step_per_token"]
    print(f"{'ms/token':<12}{1e3 * o['step_per_token']:>10.3f}{1e3 * t['step_per_token']:>10.3f}"
          f"{per_token:>9.2f}x   (step time per response token)")
    ratio = t["step"] / o["step"]
    target = args.target
    if target is None:
        target = TARGETS["equal" if args.max_new_tokens <= EQUAL_LENGTH_MAX_NEW_TOKENS else "variable"]
    verdict = "met" if ratio >= target else "NOT met"
    print(f"\ntarget: trl step / our step >= {target}x -> {ratio:.2f}x, {verdict}\n")
    print(DIFFERENCES)
    return {"benchmark": "vs_trl", "ratio": ratio, "target": target, "per_token_ratio": per_token,
            "lengths": lengths, "phases": {p: {"ours": o[p], "trl": t[p]} for p in PHASES}}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per run (>= 1)")
    p.add_argument("--rounds", type=int, default=2, help="(ours, trl) pairs of runs, alternating")
    p.add_argument("--prompts", type=int, default=32, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--hidden", type=int, default=256, help="hidden size of the tiny Qwen2")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the tiny Qwen2")
    p.add_argument("--max-new-tokens", type=int, default=EQUAL_LENGTH_MAX_NEW_TOKENS, help="longest response")
    p.add_argument("--target", type=float, default=None,
                   help="trl/ours step target (default: 1.0 at <= 8 new tokens, equal lengths; else 1.5)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per side")
    p.add_argument("--lr", type=float, default=1e-6,
                   help="AdamW lr of both sides (default 1e-6: the policy, and so the lengths, stay put)")
    p.add_argument("--decoding", default="auto", choices=("auto", "generate", "drop_finished"),
                   help="our RolloutConfig.decoding (generate: HF generate, as TRL)")
    p.add_argument("--json", type=str, default=None, help="also write the results here (for plot_results.py)")
    p.add_argument("--side", choices=("ours", "trl"), help=argparse.SUPPRESS)
    p.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        p.error("--warmup, --steps and --rounds must be >= 1 (the first step of a run has no start time)")
    return args


def run_child(args: argparse.Namespace) -> None:
    """In the subprocess: run one side and print its rows as one ``ROWS <json>`` line."""
    import torch

    torch.set_num_threads(args.threads)
    model, train_file = str(args.workdir / "model"), str(args.workdir / "task" / "train.jsonl")
    rows = (run_ours if args.side == "ours" else run_trl)(args, model, train_file)
    print("ROWS " + json.dumps(rows), flush=True)


def main() -> None:
    args = parse_args()
    try:
        import trl  # noqa: F401
    except ImportError:
        print("trl is not installed; `pip install datasets && pip install --no-deps trl` to run this")
        return
    if args.side:
        run_child(args)
        return
    runs: dict[str, list[dict[str, float]]] = {"ours": [], "trl": []}
    with tempfile.TemporaryDirectory() as tmp:
        prepare(Path(tmp), args.hidden, args.layers)
        for i in range(args.rounds):
            for side, rows in runs.items():
                t0 = time.perf_counter()
                rows.extend(run_side(side, args, Path(tmp)))
                took = time.perf_counter() - t0
                print(f"round {i + 1}/{args.rounds}: {side} took {took:.0f} s", flush=True)
    results = report(args, runs["ours"], runs["trl"])
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import save_json

    save_json(args.json, results)


if __name__ == "__main__":
    main()
