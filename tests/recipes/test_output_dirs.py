"""Recipes never delete what verl-trainer did not write: task.dir, warm_start.output, export_dir, hf/."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from recipes import common
from verl_trainer.configs import TaskConfig, TrainerConfig, WarmStartConfig
from verl_trainer.data.tasks import ArithmeticTaskConfig
from verl_trainer.utils.fs import NotOwnedError, is_owned

ROOT = Path(__file__).resolve().parents[2]
SMALL = ArithmeticTaskConfig(num_train=8, num_val=2)


def _users_dir(path: Path) -> Path:
    (path / "run1").mkdir(parents=True)
    (path / "run1" / "metrics.csv").write_text("precious")
    return path


def test_task_dir_is_written_atomically_and_a_users_directory_is_refused(tmp_path):
    users = _users_dir(tmp_path / "outputs")
    with pytest.raises(NotOwnedError, match=r"task.dir=.*outputs.*did not write"):
        common.prepare_task(TaskConfig(dir=str(users), arithmetic=SMALL))
    assert (users / "run1" / "metrics.csv").read_text() == "precious"

    task = tmp_path / "task"
    common.prepare_task(TaskConfig(dir=str(task), arithmetic=SMALL))
    assert (task / "train.jsonl").is_file() and is_owned(task)
    (task / "train.jsonl").unlink()  # our own incomplete write: replaced
    common.prepare_task(TaskConfig(dir=str(task), arithmetic=SMALL))
    assert (task / "train.jsonl").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs", "task"]


def test_warm_start_and_export_refuse_a_users_directory_before_any_work(tmp_path):
    users = _users_dir(tmp_path / "outputs")
    cfg = WarmStartConfig(enable=True, output=str(users))
    with pytest.raises(NotOwnedError, match="warm_start.output="):
        common.warm_start(cfg, "no model needed: refused first", trainer_cfg=None)
    with pytest.raises(NotOwnedError, match="export_dir="):
        common.final_export_dir(TrainerConfig(), str(users))
    with pytest.raises(NotOwnedError, match="default_root_dir/hf="):  # the default export of every recipe
        (users / "hf").mkdir()
        (users / "hf" / "notes.txt").write_text("mine")
        common.final_export_dir(TrainerConfig(default_root_dir=str(users)))
    assert (users / "run1" / "metrics.csv").read_text() == "precious"


def test_sft_recipe_refuses_an_export_dir_it_did_not_write_before_training(tmp_path):
    users = _users_dir(tmp_path / "outputs")
    args = [sys.executable, str(ROOT / "recipes" / "sft.py"), f"export_dir={users}",
            f"trainer.default_root_dir={tmp_path / 'run'}", f"task.dir={tmp_path / 'task'}"]
    env = {**os.environ, "WANDB_MODE": "offline"}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "export_dir=" in proc.stderr and "did not write" in proc.stderr
    assert (users / "run1" / "metrics.csv").read_text() == "precious"
    assert not (tmp_path / "task").exists()  # refused before anything else was done
