"""GRPO step time: our Trainer against TRL's GRPOTrainer on the same tiny model, prompts and reward.

Both sides train a randomly initialised Qwen2 (``--hidden``, ``--layers``; made with ``make_tiny_model``)
with GRPO on the arithmetic task's prompts (``"a+b="``), our registered ``math`` reward (TRL gets it
wrapped: completion text -> score), ``--n`` samples per prompt, ``--prompts`` prompts per step,
``--max-new-tokens``, temperature 1, fp32, AdamW lr 1e-3 constant, grad clip 1.0, no KL/reference,
group-std advantages, token-mean loss over the whole step (TRL ``loss_type="dapo"``), PPO clip 0.2,
one optimizer step per generation batch, one micro-batch (the whole step) per forward, one process each.

Each side runs in its own subprocess, the sides alternating (ours, trl, ours, trl, ... ``--rounds``
pairs) so machine load hits both alike; each run warms up ``--warmup`` steps, then times ``--steps``.
Per step (medians over all timed steps of all rounds):
  * step: wall time between the ends of consecutive steps (everything each loop does: data, logging);
  * generation: ours ``timing/rollout_s`` (HF ``generate`` on the rollout copy + decode);
    TRL ``GRPOTrainer._generate`` (tokenise, HF ``generate`` on the policy, cut at eos);
  * scoring: decode + reward + group advantages (ours: ``step_s - rollout_s - update_s``; TRL:
    ``_generate_and_score_completions`` minus ``_generate``);
  * update: step - generation - scoring (ours: old log-probs, forward/backward, optimizer, weight sync
    to the rollout copy; TRL: forward/backward, optimizer). Ours' own ``timing/update_s`` is printed too.

Target (issue 9): TRL step / our step >= 1.5.

TRL is not a dependency: ``pip install trl`` (measured with trl 1.16.0); without it the script says
so and exits 0.

Usage: python bench/vs_trl.py [--steps 5] [--warmup 2] [--rounds 2] [--prompts 32] [--n 8]
                              [--hidden 256] [--layers 4] [--max-new-tokens 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET = 1.5
LR = 1e-3
SEED = 0
PHASES = ("step", "generation", "scoring", "update")
DIFFERENCES = """\
What each side computes differently (same model, prompts, reward, n, lengths, batch, optimizer):
  * Old log-probs: ours runs an extra no-grad forward over the step batch (old_log_probs, as verl);
    TRL skips it when generation and optimizer steps align (num_iterations=1, steps_per_generation=
    gradient_accumulation_steps) and uses the detached current log-probs (ratio == 1 exactly).
  * Rollout model: ours generates with a separate eval copy and streams the updated weights into it
    after each step (get_per_tensor_param); TRL generates with the policy itself (no copy, no sync).
  * Padding: ours packs the samples into one row without padding (varlen attention, position ids per
    sample) for old log-probs and the update; TRL forwards the [B, P + C] batch, left-padded prompts
    and right-padded completions, with an attention mask.
  * LM head: TRL patches a fused, tiled head that projects only the completion positions and returns
    log-probs and entropy; ours projects every packed position and takes log-softmax of full logits
    (no entropy unless calculate_entropy).
  * Wrapping: ours runs the model under FSDP2 (one rank, hooks and DTensor parameters included);
    TRL under accelerate without a wrapper on one CPU process.
  * Metrics: TRL computes entropy, clip ratios (gathered), reward stats and per-function rewards every
    step and logs them (logging_steps=1); ours reduces declared metrics (reward, length, advantages,
    pg loss/clipfrac/kl, grad norm) and logs nothing here (logger=False).
  * Loss normalisation: the same token-mean over the step's response tokens (TRL dapo: num_items_in_batch
    over the generation batch); both clip at 0.2 and use group mean/std advantages (TRL std with
    +1e-4, ours verl's +1e-6).
  * Sampling RNG: different streams (each side is seeded, but draws differ), so response lengths
    and rewards differ sample by sample; their distributions are the same."""


# ------------------------------------------------------------------------------------------ setup
def prepare(workdir: Path, hidden: int, layers: int) -> tuple[str, str]:
    """Write the tiny model and the arithmetic task under ``workdir``; return their paths."""
    from verl_trainer.data.tasks import ArithmeticTaskConfig, write_arithmetic_task
    from verl_trainer.models.tiny import make_tiny_model

    heads = max(1, hidden // 64)
    model = make_tiny_model(workdir / "model", hidden_size=hidden, num_hidden_layers=layers,
                            num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), seed=SEED)
    files = write_arithmetic_task(workdir / "task", ArithmeticTaskConfig(num_train=2000, num_val=10, seed=SEED))
    return model, str(files["train"])


# ------------------------------------------------------------------------------------------ our side
def run_ours(args: argparse.Namespace, model: str, train_file: str) -> list[dict[str, float]]:
    """``--warmup + --steps`` GRPO steps with our Trainer; per-step timings of the timed steps."""
    from verl_trainer.algorithms import GRPO, PromptDataModule
    from verl_trainer.algorithms.config import ActorConfig, GRPOConfig, RewardConfig
    from verl_trainer.algorithms.data import DataConfig
    from verl_trainer.callbacks import Callback
    from verl_trainer.engine.config import EngineConfig, OptimConfig
    from verl_trainer.losses import PPOLossConfig
    from verl_trainer.models.tiny import load_tokenizer
    from verl_trainer.rollout.config import RolloutConfig
    from verl_trainer.trainer import Trainer

    class StepTimes(Callback):
        def __init__(self) -> None:
            self.rows: list[dict[str, float]] = []
            self.last_end: float | None = None

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            now = time.perf_counter()
            if self.last_end is not None:
                rollout, update, step = (float(outputs[f"timing/{k}_s"]) for k in ("rollout", "update", "step"))
                self.rows.append({"step": now - self.last_end, "generation": rollout,
                                  "scoring": step - rollout - update, "update_s": update})
            self.last_end = now

    batch = args.prompts * args.n
    config = GRPOConfig(
        model_path=model,
        actor=ActorConfig(
            engine=EngineConfig(micro_batch_size_per_gpu=batch, seed=SEED),
            optim=OptimConfig(lr=LR, weight_decay=0.0, clip_grad=1.0, lr_scheduler="constant"),
            loss=PPOLossConfig(clip_ratio=0.2, loss_agg_mode="token-mean", use_kl_loss=False),
            ppo_mini_batch_size=args.prompts, ppo_epochs=1,
        ),
        rollout=RolloutConfig(n=args.n, max_new_tokens=args.max_new_tokens, temperature=1.0, seed=SEED),
        reward=RewardConfig(name="math"),
        norm_adv_by_std_in_grpo=True,
    )
    data = PromptDataModule(DataConfig(train_files=train_file, train_batch_size=args.prompts,
                                       max_prompt_length=16), load_tokenizer(model))
    timer = StepTimes()
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(strategy="fsdp2", accelerator="cpu", devices=1, max_steps=args.warmup + args.steps,
                          logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          default_root_dir=root, callbacks=[timer], seed=SEED)
        trainer.fit(GRPO(config), datamodule=data)
    return timer.rows[args.warmup - 1:] if args.warmup else timer.rows  # row i is step i+1 (step 0 has no start)


# ------------------------------------------------------------------------------------------ TRL side
def math_reward_for_trl() -> Any:
    """Our registered ``math`` reward in TRL's reward-function form (TRL passes dataset columns as kwargs)."""
    from verl_trainer.rewards import get_reward_fn

    score = get_reward_fn("math")

    def math_reward(prompts: list[str], completions: list[str], ground_truth: list[str],
                    data_source: list[str], **kwargs: Any) -> list[float]:
        results = (score(src, text, gt) for src, text, gt in zip(data_source, completions, ground_truth))
        return [float(r["score"] if isinstance(r, dict) else r) for r in results]

    return math_reward


def trl_dataset(train_file: str) -> Any:
    """The task's prompt rows as a ``datasets.Dataset`` with ``prompt``, ``ground_truth``, ``data_source``."""
    import datasets

    rows = [json.loads(line) for line in Path(train_file).read_text().splitlines() if line.strip()]
    return datasets.Dataset.from_dict({
        "prompt": [r["prompt"] for r in rows],
        "ground_truth": [r["reward_model"]["ground_truth"] for r in rows],
        "data_source": [r["data_source"] for r in rows],
    })


def run_trl(args: argparse.Namespace, model: str, train_file: str) -> list[dict[str, float]]:
    """``--warmup + --steps`` steps of TRL's GRPOTrainer; per-step timings of the timed steps."""
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from verl_trainer.models.tiny import load_causal_lm, load_tokenizer

    phase_s = {"generation": 0.0, "generate_and_score": 0.0}

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate(self, *a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            out = super()._generate(*a, **kw)
            phase_s["generation"] += time.perf_counter() - t0
            return out

        def _generate_and_score_completions(self, *a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(*a, **kw)
            phase_s["generate_and_score"] += time.perf_counter() - t0
            return out

    rows: list[dict[str, float]] = []

    class StepTimes(TrainerCallback):
        last_end: float | None = None

        def on_step_end(self, *a: Any, **kw: Any) -> None:
            now = time.perf_counter()
            if self.last_end is not None:
                gen, gen_score = phase_s["generation"], phase_s["generate_and_score"]
                rows.append({"step": now - self.last_end, "generation": gen, "scoring": gen_score - gen})
            self.last_end = now
            phase_s.update(generation=0.0, generate_and_score=0.0)

    with tempfile.TemporaryDirectory() as out_dir:
        config = GRPOConfig(
            output_dir=out_dir, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
            logging_steps=1, disable_tqdm=True, gradient_checkpointing=False, seed=SEED, data_seed=SEED,
            max_steps=args.warmup + args.steps, learning_rate=LR, lr_scheduler_type="constant",
            weight_decay=0.0, max_grad_norm=1.0, warmup_steps=0,
            per_device_train_batch_size=args.prompts * args.n, gradient_accumulation_steps=1,
            num_generations=args.n, num_iterations=1, max_completion_length=args.max_new_tokens,
            temperature=1.0, top_p=1.0, top_k=0, beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        )
        trainer = TimedGRPOTrainer(
            model=load_causal_lm(model), reward_funcs=[math_reward_for_trl()], args=config,
            train_dataset=trl_dataset(train_file), processing_class=load_tokenizer(model),
            callbacks=[StepTimes()],
        )
        trainer.train()
    return rows[args.warmup - 1:] if args.warmup else rows


# ------------------------------------------------------------------------------------------ driver
def run_side(side: str, args: argparse.Namespace, workdir: Path) -> list[dict[str, float]]:
    """One run of ``side`` in a fresh subprocess; its per-step rows."""
    cmd = [sys.executable, __file__, "--side", side, "--workdir", str(workdir)]
    for flag in ("steps", "warmup", "prompts", "n", "hidden", "layers", "max_new_tokens", "threads"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    env = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ROWS ")]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"the {side} run failed (exit {proc.returncode})")
    return json.loads(lines[-1][5:])


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    med["update"] = statistics.median(r["step"] - r["generation"] - r["scoring"] for r in rows)
    return med


def report(args: argparse.Namespace, ours: list[dict[str, float]], trl: list[dict[str, float]]) -> None:
    import torch
    import trl as trl_pkg

    o, t = medians(ours), medians(trl)
    print(f"\nGRPO, Qwen2 hidden {args.hidden} x {args.layers} layers, {args.prompts} prompts x n={args.n}, "
          f"max_new_tokens {args.max_new_tokens}, fp32 CPU, {args.threads} thread(s) per side; "
          f"trl {trl_pkg.__version__}, torch {torch.__version__}")
    print(f"median over {len(ours)} (ours) / {len(trl)} (trl) timed steps, {args.rounds} alternating rounds\n")
    print(f"{'phase':<12}{'ours (s)':>10}{'trl (s)':>10}{'trl/ours':>10}")
    for phase in PHASES:
        print(f"{phase:<12}{o[phase]:>10.3f}{t[phase]:>10.3f}{t[phase] / o[phase]:>9.2f}x")
    ratio = t["step"] / o["step"]
    verdict = "met" if ratio >= TARGET else "NOT met"
    print(f"\nours timing/update_s (old log-probs + update + weight sync): {o['update_s']:.3f} s")
    print(f"target: trl step / our step >= {TARGET}x -> {ratio:.2f}x, {verdict}\n")
    print(DIFFERENCES)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per run (>= 1)")
    p.add_argument("--rounds", type=int, default=2, help="(ours, trl) run pairs, alternating")
    p.add_argument("--prompts", type=int, default=32, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--hidden", type=int, default=256, help="hidden size of the tiny Qwen2")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the tiny Qwen2")
    p.add_argument("--max-new-tokens", type=int, default=8, help="longest response")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads of each side")
    p.add_argument("--side", choices=("ours", "trl"), help=argparse.SUPPRESS)
    p.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.warmup < 1:
        p.error("--warmup must be >= 1 (the first step has no start time)")
    return args


def main() -> None:
    args = parse_args()
    try:
        import trl  # noqa: F401
    except ImportError:
        print("trl is not installed; `pip install trl` to run this benchmark")
        return
    if args.side:
        import torch

        torch.set_num_threads(args.threads)
        model, train_file = str(args.workdir / "model"), str(next((args.workdir / "task").glob("train.*")))
        rows = (run_ours if args.side == "ours" else run_trl)(args, model, train_file)
        print("ROWS " + json.dumps(rows), flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        prepare(workdir, args.hidden, args.layers)
        ours: list[dict[str, float]] = []
        trl_rows: list[dict[str, float]] = []
        for i in range(args.rounds):
            for side, rows in (("ours", ours), ("trl", trl_rows)):
                t0 = time.perf_counter()
                rows.extend(run_side(side, args, workdir))
                print(f"round {i + 1}/{args.rounds}: {side} run took {time.perf_counter() - t0:.0f} s", flush=True)
    report(args, ours, trl_rows)


if __name__ == "__main__":
    main()
