"""``python recipes/grpo.py trainer.strategy=megatron``: the demo learns, and a killed run resumes exactly.

Both run the recipe as a user does, at 2 ranks on CPU, with the Megatron engine for the warm start, the actor
and the reference (``engine/megatron.py``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

pytest.importorskip("megatron.core")

from tests.recipes.test_recipe_checkpoints import _env, _grpo_command, _run  # noqa: E402
from tests.recipes.test_recipes import ROOT, assets  # noqa: E402, F401  (fixture)
from tests.trainer.common import read_csv_metrics  # noqa: E402

pytestmark = pytest.mark.megatron

MEGATRON = "trainer.strategy=megatron"


def test_grpo_demo_learns_with_megatron(tmp_path):
    """The README's demo (its tiny Qwen2, the arithmetic task, the SFT warm start), 40 steps: reward rises.

    Measured: validation reward 0.235 -> 0.37, accuracy 0.15 -> 0.30; the last ten steps' mean training
    reward about 0.1 above the first ten's.
    """
    args = [sys.executable, str(ROOT / "recipes" / "grpo.py"), MEGATRON, "trainer.devices=2",
            "trainer.max_steps=40", "trainer.val_check_interval=20", "trainer.logger=[csv]"]
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "SFT warm start: 40 steps" in proc.stdout
    metrics = read_csv_metrics(tmp_path / "outputs" / "grpo")
    rewards = [metrics[step]["reward/mean"] for step in range(1, 41)]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.05, (first, last)
    vals = [m["val/reward/mean"] for _, m in sorted(metrics.items()) if "val/reward/mean" in m]
    assert vals[-1] > vals[0], vals
    assert (tmp_path / "outputs" / "grpo" / "hf" / "model.safetensors").is_file()


def test_grpo_killed_after_step_3_and_resumed_equals_uninterrupted(assets, tmp_path):  # noqa: F811
    """SIGKILL once step 3's checkpoint exists, resume with ``trainer.ckpt_path=last``: the same run."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    _run(_grpo_command(assets, full, MEGATRON))
    proc = subprocess.Popen(_grpo_command(assets, cut, MEGATRON), cwd=ROOT, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600
    while not (cut / "checkpoints" / "step_000003" / "trainer_state.pt").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before step 3's checkpoint"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert not (cut / "checkpoints" / "step_000006").exists()
    assert sorted(p.name for p in (cut / "checkpoints" / "step_000003").glob("**/megatron/rank_*.pt"))

    _run(_grpo_command(assets, cut, MEGATRON, "trainer.ckpt_path=last"))
    want, got = read_csv_metrics(full), read_csv_metrics(cut)
    assert sorted(want) == sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in want:
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/lr", "response_length/mean"):
            assert got[step][key] == want[step][key], (step, key, got[step][key], want[step][key])
    want_w, got_w = (load_file(Path(root) / "hf" / "model.safetensors") for root in (full, cut))
    assert want_w.keys() == got_w.keys()
    assert all(bool((got_w[name] == value).all()) for name, value in want_w.items())
