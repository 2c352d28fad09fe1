"""A TRL user's GRPO script, run on verl-trainer.

What a TRL ``GRPOTrainer`` quickstart has: a prompt dataset with extra columns, reward functions with
TRL's signature ``f(prompts, completions, **columns) -> list[float | None]`` passed as a list with
weights (``reward_funcs`` / ``reward_weights``), ``num_generations`` samples per prompt. Here they are
``RewardConfig(name=[...], weights=[...])`` and ``rollout.n``; each function's mean is logged as
``reward/<name>/mean``. The model is a tiny Qwen2 built here (no download), so the rewards are ones a
random model can learn within a minute: answer with digits, and short.

    python examples/trl_style_grpo.py --root /tmp/trl_style           # CPU, ~1 minute
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from verl_trainer import Trainer
from verl_trainer.algorithms import GRPO, DataConfig, GRPOConfig, PromptDataModule
from verl_trainer.algorithms.config import ActorConfig, RewardConfig
from verl_trainer.callbacks import Callback
from verl_trainer.engine import OptimConfig
from verl_trainer.models.loading import load_tokenizer
from verl_trainer.models.tiny import make_tiny_model
from verl_trainer.rollout import RolloutConfig


def digits(completions: list[str], **kwargs) -> list[float]:
    """The fraction of a completion's characters that are digits (0 for an empty one)."""
    return [sum(ch.isdigit() for ch in c) / len(c) if c else 0.0 for c in completions]


def starts_with_answer(prompts: list[str], completions: list[str], ground_truth: list[str],
                       **kwargs) -> list[float | None]:
    """1 when the completion starts with the row's ``ground_truth``; ``None`` (left out) without one."""
    return [None if a is None else float(c.strip().startswith(a)) for c, a in zip(completions, ground_truth)]


def write_dataset(path: Path, n: int, seed: int = 0) -> Path:
    """``n`` rows ``{"prompt": "a+b=", "ground_truth": "c"}`` as jsonl."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.randrange(10), rng.randrange(10)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "ground_truth": str(a + b)}) + "\n")
    return path


class RewardHistory(Callback):
    """Keeps each step's reduced rewards (the loop reduces them before any callback runs)."""

    KEYS = ("reward/mean", "reward/digits/mean", "reward/starts_with_answer/mean")

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        """Record this step's rewards."""
        self.steps.append({k: float(trainer.callback_metrics[k]) for k in self.KEYS})

    def window(self, at: int, size: int = 5) -> dict[str, float]:
        """Mean of each reward over the first (``at=0``) or last (``at=-1``) ``size`` steps."""
        steps = self.steps[:size] if at == 0 else self.steps[-size:]
        return {k: sum(s[k] for s in steps) / len(steps) for k in self.KEYS}


def main() -> None:
    """Build the tiny model and the data, fit GRPO, print the first and last rewards."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="outputs/trl_style")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=30)
    args = parser.parse_args()
    root = Path(args.root)
    model = make_tiny_model(root / "model", hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                            seed=1)
    config = GRPOConfig(
        model_path=str(model),
        rollout=RolloutConfig(n=8, max_new_tokens=4),  # TRL: num_generations, max_completion_length
        reward=RewardConfig(name=[digits, starts_with_answer], weights=[1.0, 2.0]),
        actor=ActorConfig(optim=OptimConfig(lr=5e-3, weight_decay=0.0, clip_grad=1.0)),
    )
    data = PromptDataModule(DataConfig(train_files=str(write_dataset(root / "train.jsonl", 256)),
                                       train_batch_size=8, max_prompt_length=8), load_tokenizer(model))
    history = RewardHistory()
    trainer = Trainer(devices=args.devices, max_steps=args.max_steps, logger="csv", default_root_dir=root,
                      callbacks=[history], enable_progress_bar=False, enable_checkpointing=False)
    trainer.fit(GRPO(config), datamodule=data)
    if trainer.is_global_zero:
        first, last = history.window(0), history.window(-1)
        print(f"steps={trainer.global_step} " + " ".join(
            f"{name}={first[name]:.3f}->{last[name]:.3f}" for name in first), flush=True)


if __name__ == "__main__":
    main()
