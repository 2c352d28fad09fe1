"""``recipes/distill.py``: its config loads (default suite), and the demo run distils (``slow``: ~2.5 min)."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_trainer.algorithms.distill_config import DistillGRPOConfig
from verl_trainer.recipe_config import load_config
from verl_trainer.recipe_config.distill import DistillRecipeConfig

ROOT = Path(__file__).resolve().parents[2]


def test_config_loads_and_refuses_a_bad_mode():
    cfg = load_config(DistillRecipeConfig, ROOT / "configs" / "distill.yaml")
    assert isinstance(cfg.algorithm, DistillGRPOConfig)
    assert (cfg.algorithm.distill.mode, cfg.algorithm.distill.kl_estimator) == ("loss", "k2")
    assert cfg.teacher.tiny.hidden_size > cfg.model.tiny.hidden_size  # the teacher is the wider model
    with pytest.raises(ValueError, match="mode='kd'; choose one of reward, loss"):
        load_config(DistillRecipeConfig, ROOT / "configs" / "distill.yaml", ["algorithm.distill.mode=kd"])


def _column(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key) not in (None, "")]


@pytest.mark.slow
def test_the_student_approaches_the_teacher(tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "distill.py"), "trainer.export_hf=false"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (log,) = (tmp_path / "outputs" / "distill").rglob("metrics.csv")
    rows = list(csv.DictReader(log.open()))
    kl = _column(rows, "distill/reverse_kl")
    val = _column(rows, "val/reward/mean")
    assert len(kl) == 300 and all(math.isfinite(v) for v in kl)
    assert sum(kl[-10:]) / 10 < 0.5 * sum(kl[:10]) / 10, kl  # student -> teacher KL falls (3.04 -> 0.65)
    assert val[-1] > val[0] + 0.1, val  # validation reward rises (0.235 -> 0.685, the teacher's, measured)
    assert "teacher val/reward/mean" in proc.stdout
