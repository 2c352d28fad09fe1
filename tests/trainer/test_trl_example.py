"""The TRL-style GRPO example (``examples/trl_style_grpo.py``) runs as a user would run it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trl_style_grpo.py"


def test_trl_style_grpo_example_runs_and_its_rewards_rise(tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [sys.executable, str(EXAMPLE), "--root", str(tmp_path), "--max-steps", "12"]
    proc = subprocess.run(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    found = re.search(r"steps=(\d+) reward/mean=([\d.]+)->([\d.]+) reward/digits/mean=([\d.]+)->([\d.]+) "
                      r"reward/starts_with_answer/mean=([\d.]+)->([\d.]+)", proc.stdout)
    assert found, proc.stdout[-4000:]
    steps, mean0, mean1, digits0, digits1, _, _ = found.groups()
    assert int(steps) == 12
    assert float(digits1) > float(digits0) + 0.1  # the TRL-signature reward is learned
    assert float(mean1) > float(mean0)
    assert list(tmp_path.glob("lightning_logs/version_*/metrics.csv"))
