"""The CPU learning demo, short: ``configs/grpo_tools.yaml`` (SFT warm start on calculator tool-use traces,
then GRPO with multi-turn rollouts) as ``python recipes/grpo.py``; the validation reward and the rate of
correct tool use rise. Sizes are cut to fit ~3 minutes on 2 cores; the measured full run is in
``docs/agents.md`` ("The learning demo")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.common import read_csv_metrics

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
SHORT = (
    f"trainer.max_steps={STEPS}", f"trainer.val_check_interval={STEPS}", "trainer.logger=[csv]",
    "trainer.enable_checkpointing=false", "trainer.export_hf=false",
)


@pytest.mark.slow
def test_the_tools_demo_learns_to_use_the_calculator(tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "grpo.py"), "--config",
                           str(ROOT / "configs" / "grpo_tools.yaml"), *SHORT],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    metrics = read_csv_metrics(tmp_path / "outputs" / "grpo_tools")
    before, after = metrics[0], metrics[STEPS]
    assert after["val/reward/mean"] >= before["val/reward/mean"] + 0.15, (before, after)
    early = sum(metrics[s]["agent/correct_tool_use"] for s in (1, 2)) / 2
    late = sum(metrics[s]["agent/correct_tool_use"] for s in (STEPS - 1, STEPS)) / 2
    assert late >= early + 0.15, (early, late)
