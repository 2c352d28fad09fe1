"""The reasoning-gym CPU demo, short: ``configs/grpo_reasoning_gym.yaml`` as ``python recipes/grpo.py``
(reasoning-gym data paths for the RL prompts, the held-out validation prompts and the SFT warm start; the
task's own verifier as the reward), STEPS GRPO steps instead of the full run. The greedy validation reward
on the held-out prompts must rise by RISE (docs/environments.md has the measured curve)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym", reason="needs the envs extra: pip install -e '.[envs]'")

from tests.trainer.common import read_csv_metrics

ROOT = Path(__file__).resolve().parents[2]
STEPS = 75  # the documented curve's step 75 clears both thresholds with margin (below)
RISE = 0.03


@pytest.mark.slow
def test_the_reasoning_gym_demo_learns_the_task(tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "grpo.py"), "--config",
                           str(ROOT / "configs" / "grpo_reasoning_gym.yaml"), f"trainer.max_steps={STEPS}",
                           f"trainer.val_check_interval={STEPS}", "trainer.logger=[csv]",
                           "algorithm.actor.optim.total_training_steps=300",  # the measured run's first steps
                           "trainer.enable_checkpointing=false", "trainer.export_hf=false"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    metrics = read_csv_metrics(tmp_path / "outputs" / "grpo_reasoning_gym")
    before, after = metrics[0], metrics[STEPS]
    assert after["val/reward/mean"] >= before["val/reward/mean"] + RISE, (before, after)
    # 5 of the 110 held-out words more reversed exactly (measured at step 75: accuracy 0.145 -> 0.218, 8
    # words; val reward 0.633 -> 0.682, +0.049; the same as docs/environments.md's curve at step 75)
    assert after["val/reward/accuracy"] >= before["val/reward/accuracy"] + 5 / 110 - 1e-6, (before, after)
