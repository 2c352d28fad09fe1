"""The MoE GRPO recipe: its config, a 2-rank run with rollout router replay, and the CPU demo (slow)."""

import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.recipes.test_recipes import RL_OVERRIDES, run_recipe
from tests.trainer.common import read_csv_metrics
from verl_trainer.data.tasks import ArithmeticTaskConfig, write_arithmetic_task
from verl_trainer.models.tiny import make_tiny_model
from verl_trainer.recipe_config import GRPORecipeConfig, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_grpo_moe_config_turns_on_replay_and_the_router_losses():
    cfg = load_config(GRPORecipeConfig, ROOT / "configs" / "grpo_moe.yaml")
    moe = cfg.algorithm.actor.engine.moe
    assert cfg.model.tiny.arch == "qwen3_moe"
    assert (moe.router_replay, moe.aux_loss_coeff, moe.z_loss_coeff) == ("rollout", 0.001, 0.0001)


def test_grpo_with_rollout_router_replay_at_two_ranks(tmp_path):
    """Two steps at dp=2 with sequence balancing: the recorded experts travel with their samples."""
    make_tiny_model(tmp_path / "model", arch="qwen3_moe", hidden_size=32, num_attention_heads=4,
                    num_key_value_heads=2, seed=1)
    task = ArithmeticTaskConfig(num_train=64, num_val=4, holdout_fraction=0.2)
    write_arithmetic_task(tmp_path / "data", task)
    metrics = run_recipe("grpo", tmp_path, tmp_path / "run", *RL_OVERRIDES,
                         "algorithm.actor.engine.moe.router_replay=rollout",
                         "algorithm.actor.engine.moe.aux_loss_coeff=0.01")
    step = metrics[1]
    assert step["moe/aux_loss"] >= 1.0 - 1e-6  # the balanced minimum is 1
    assert 1.0 <= step["moe/load_imbalance"] <= 2.0  # E / k = 2 at most
    assert "moe/z_loss" not in step  # its coefficient is 0: not computed


@pytest.mark.slow  # the CPU demo's first 100 steps: about 2 minutes on the 2-core machine
def test_grpo_moe_demo_reward_rises(tmp_path):
    """The demo config's sampled reward rises over 100 steps (the full 300: docs/moe.md)."""
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "grpo.py"), "--config",
                           str(ROOT / "configs" / "grpo_moe.yaml"), "trainer.logger=[csv]",
                           "trainer.max_steps=100", "trainer.val_check_interval=null",
                           "trainer.enable_checkpointing=false"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_csv_metrics(tmp_path / "outputs" / "grpo_moe")
    rewards = [m["reward/mean"] for _, m in sorted(rows.items()) if "reward/mean" in m]
    assert len(rewards) == 100
    assert statistics.mean(rewards[-20:]) > statistics.mean(rewards[:20]) + 0.15, rewards
    assert all(1.0 <= m["moe/load_imbalance"] <= 2.0 for m in rows.values() if "moe/load_imbalance" in m)
