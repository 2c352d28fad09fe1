"""The Lightning-style example (``examples/lightning_style.py``) runs as a user would run it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning_style.py"


def test_lightning_style_example_runs(tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--root", str(tmp_path)], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    pattern = r"steps=(\d+) val/loss=([\d.]+) test/loss=([\d.]+) assistant_tokens=(\d+) predicted=(\d+)"
    found = re.search(pattern, proc.stdout)
    assert found, proc.stdout[-4000:]
    steps, val, test, tokens, predicted = found.groups()
    assert int(steps) == 4  # 2 epochs x limit_train_batches=4 / accumulate_grad_batches=2
    assert float(val) == float(test) > 0  # test data = validation data, the final model
    assert int(tokens) > 0 and int(predicted) == 8
    assert list(tmp_path.glob("lightning_logs/version_*/metrics.csv"))
