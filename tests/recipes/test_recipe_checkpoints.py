"""Recipes checkpoint every N steps and resume with ``trainer.ckpt_path`` (issue 13 item 3).

Default run: the keys of every recipe config (``trainer.checkpoint.*``, ``trainer.ckpt_path``) and the
``ModelCheckpoint`` they build, and the early error for a ``ckpt_path`` that is no checkpoint. ``slow``:
``python recipes/grpo.py`` at 2 ranks for 6 steps, SIGKILLed once step 3's checkpoint exists, resumed
with ``trainer.ckpt_path=last``, equals the uninterrupted run: the same per-step rewards, losses and grad
norms (exactly) and the same final weights.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.recipes.test_config_loading import CONFIGS, RECIPES
from tests.recipes.test_recipes import RL_OVERRIDES, ROOT, assets  # noqa: F401  (fixture)
from tests.trainer.common import read_csv_metrics
from verl_trainer.callbacks import ModelCheckpoint
from verl_trainer.recipe_config import GRPORecipeConfig, load_config


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_checkpoints_periodically(name):
    cfg = load_config(RECIPES[name], CONFIGS / f"{name}.yaml")
    assert cfg.trainer.enable_checkpointing and cfg.trainer.checkpoint.every_n_train_steps >= 1
    assert cfg.trainer.ckpt_path is None and cfg.trainer.validates_before_fit
    trainer = cfg.trainer.build(accelerator="cpu", devices=1, logger=False)
    (ckpt,) = [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]
    assert ckpt.every_n_train_steps == cfg.trainer.checkpoint.every_n_train_steps
    assert ckpt.keep_last_k == cfg.trainer.checkpoint.keep_last_k


def test_checkpoint_keys_and_resume_path(tmp_path):
    cfg = load_config(GRPORecipeConfig, CONFIGS / "grpo.yaml", [
        "trainer.checkpoint.every_n_train_steps=3", "trainer.checkpoint.keep_last_k=4",
        f"trainer.checkpoint.dirpath={tmp_path / 'ck'}", "trainer.ckpt_path=last",
    ])
    trainer = cfg.trainer.build(accelerator="cpu", devices=1, logger=False)
    (ckpt,) = [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]
    assert (ckpt.every_n_train_steps, ckpt.keep_last_k, ckpt.dirpath) == (3, 4, tmp_path / "ck")
    assert not cfg.trainer.validates_before_fit  # a resume has no "before training" number
    off = load_config(GRPORecipeConfig, CONFIGS / "grpo.yaml", ["trainer.enable_checkpointing=false"])
    trainer = off.trainer.build(accelerator="cpu", devices=1, logger=False)
    assert not any(isinstance(cb, ModelCheckpoint) for cb in trainer.callbacks)


def test_bad_checkpoint_settings_fail_at_config_load(tmp_path):
    with pytest.raises(ValueError, match=r"trainer.ckpt_path='.*nowhere' is not a complete checkpoint"):
        load_config(GRPORecipeConfig, CONFIGS / "grpo.yaml", [f"trainer.ckpt_path={tmp_path / 'nowhere'}"])
    with pytest.raises(ValueError, match=r"trainer.checkpoint.every_n_train_steps=0 must be an int >= 1"):
        load_config(GRPORecipeConfig, CONFIGS / "grpo.yaml", ["trainer.checkpoint.every_n_train_steps=0"])


def _grpo_command(base: Path, root: Path, *extra: str) -> list[str]:
    return [
        sys.executable, str(ROOT / "recipes" / "grpo.py"),
        "trainer.devices=2", "trainer.max_steps=6", "trainer.val_check_interval=null", "trainer.logger=[csv]",
        "trainer.validate_before_fit=false", "trainer.checkpoint.every_n_train_steps=1",
        "trainer.checkpoint.keep_last_k=2", f"trainer.default_root_dir={root}",
        f"model.path={base / 'model'}", "model.make_tiny_if_missing=false", f"task.dir={base / 'data'}",
        "task.write_if_missing=false", "data.train_batch_size=4", "algorithm.rollout.n=2", *RL_OVERRIDES,
        *extra,
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def _final_weights(root: Path) -> dict[str, torch.Tensor]:
    """The actor's parameters in the step-6 checkpoint (DCP, converted on this process)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    (meta,) = (root / "checkpoints" / "step_000006" / "engines" / "actor").glob("**/.metadata")
    out = root / "final.pt"
    dcp_to_torch_save(meta.parent, out)
    state = torch.load(out, weights_only=False)  # our own file, written just now
    return {k: v for k, v in _flat(state).items() if isinstance(v, torch.Tensor) and "model" in k}


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: tree}


@pytest.mark.slow
def test_grpo_recipe_killed_after_step_3_and_resumed_equals_uninterrupted(assets, tmp_path):  # noqa: F811
    full, cut = tmp_path / "full", tmp_path / "cut"
    _run(_grpo_command(assets, full))

    proc = subprocess.Popen(_grpo_command(assets, cut), cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600
    while not (cut / "checkpoints" / "step_000003" / "trainer_state.pt").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before step 3's checkpoint"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert not (cut / "checkpoints" / "step_000006").exists()

    _run(_grpo_command(assets, cut, "trainer.ckpt_path=last"))
    want, got = read_csv_metrics(full), read_csv_metrics(cut)
    assert sorted(want) == sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in want:
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/lr", "response_length/mean"):
            assert got[step][key] == want[step][key], (step, key, got[step][key], want[step][key])
    want_w, got_w = _final_weights(full), _final_weights(cut)
    assert want_w and sorted(want_w) == sorted(got_w)
    for name, value in want_w.items():
        assert torch.equal(got_w[name], value), name
