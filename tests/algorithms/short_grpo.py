"""A short GRPO run's pieces, shared by the rollout tests: a tiny model with the arithmetic task, and the
demo recipe's config at a small batch (4 prompts x 4 samples, 4 new tokens, TIS on, lr 1e-2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.trainer.common import tiny_model
from verl_trainer.callbacks import Callback
from verl_trainer.data.tasks import ArithmeticTaskConfig, write_arithmetic_task
from verl_trainer.models import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def make_assets(base: Path, num_train: int = 24) -> Path:
    """``base/model`` (a tiny Llama) and ``base/data`` (the arithmetic task, 4 validation prompts)."""
    tiny_model(base / "model")
    task = ArithmeticTaskConfig(num_train=num_train, num_val=4, holdout_fraction=0.2)
    write_arithmetic_task(base / "data", task)
    return base


def make_varied_reward_assets(base: Path) -> Path:
    """:func:`make_assets` (40 prompts) plus ``base/reward.py:length``, a reward that varies on a random
    model (the task's own reward is 0 everywhere there), so advantages and updates are non-zero."""
    make_assets(base, num_train=40)
    return write_varied_reward(base)


def write_varied_reward(base: Path) -> Path:
    """``base/reward.py:length``: a reward that varies on a random model; returns ``base``."""
    (base / "reward.py").write_text(
        "def length(prompts, completions, **kwargs):\n"
        "    return [float(sum(map(ord, c)) % 7) for c in completions]\n")
    return base


VLLM_OVERRIDES = ("algorithm.rollout.name=vllm", "algorithm.rollout.max_model_len=64")
"""The vLLM rollout on :func:`make_vllm_grpo_assets` (its 128-position model: a 64-token context)."""


def make_vllm_grpo_assets(base: Path, num_train: int) -> Path:
    """A tiny llama with head size 32 (vLLM CPU's smallest), the arithmetic task with ``num_train`` prompts
    and 4 validation ones, and :func:`write_varied_reward`; returns ``base``."""
    make_tiny_model(base / "model", arch="llama", hidden_size=64, num_attention_heads=2,
                    num_key_value_heads=1, max_position_embeddings=128, seed=1)
    write_arithmetic_task(base / "data", ArithmeticTaskConfig(num_train=num_train, num_val=4,
                                                              holdout_fraction=0.2))
    return write_varied_reward(base)


def short_grpo_config(model: str, data: str, *overrides: str) -> Any:
    """``configs/grpo.yaml`` with the small batch above and ``overrides`` (a ``GRPORecipeConfig``)."""
    from verl_trainer.recipe_config import GRPORecipeConfig, load_config

    return load_config(GRPORecipeConfig, ROOT / "configs" / "grpo.yaml", [
        f"algorithm.model_path={model}", f"data.train_files={data}/train.jsonl",
        f"data.val_files={data}/val.jsonl", "data.train_batch_size=4", "algorithm.rollout.n=4",
        "algorithm.rollout.max_new_tokens=4", "algorithm.actor.ppo_mini_batch_size=4",
        "algorithm.rollout_correction.level=token", "algorithm.actor.optim.lr=1e-2", *overrides,
    ])


class StepRecord(Callback):
    """Per step of a fit: the prompt batch, the rollout batch and the logged metrics (copies)."""

    def __init__(self) -> None:
        self.prompts: list = []
        self.rollouts: list = []
        self.metrics: list[dict[str, float]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.prompts.append(batch.clone())

    def on_rollout_end(self, trainer, module, batch) -> None:
        self.rollouts.append(batch.clone())

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.metrics.append(dict(trainer.callback_metrics))
