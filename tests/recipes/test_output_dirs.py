"""Recipes never delete what verl-trainer did not write: task.dir, warm_start.output, export_dir, hf/."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_trainer.data.tasks import ArithmeticTaskConfig
from verl_trainer.recipe_config import TaskConfig, TrainerConfig, WarmStartConfig
from verl_trainer.recipes import common
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


def test_task_warm_start_and_export_dirs_never_replace_a_checkpoint(tmp_path):
    from verl_trainer.engine.checkpoint import atomic_checkpoint_dir

    ckpt = tmp_path / "checkpoints" / "step_000003"
    with atomic_checkpoint_dir(ckpt, run_id="r1") as tmp:
        (tmp / "trainer_state.pt").write_bytes(b"state")
    kind = r"'checkpoint' directory verl-trainer wrote.*Choose another directory"
    with pytest.raises(NotOwnedError, match=rf"task.dir=.*step_000003.*{kind}"):
        common.prepare_task(TaskConfig(dir=str(ckpt), arithmetic=SMALL))
    with pytest.raises(NotOwnedError, match=rf"warm_start.output=.*{kind}"):
        common.warm_start(WarmStartConfig(enable=True, output=str(ckpt)), "refused first", trainer_cfg=None)
    with pytest.raises(NotOwnedError, match=rf"export_dir=.*{kind}"):
        common.final_export_dir(TrainerConfig(), str(ckpt))
    assert (ckpt / "trainer_state.pt").read_bytes() == b"state"
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["step_000003"]


def test_changed_task_settings_rebuild_the_task_and_a_users_files_are_kept(tmp_path, capsys):
    import dataclasses

    task = tmp_path / "task"
    common.prepare_task(TaskConfig(dir=str(task), arithmetic=SMALL))
    rows = (task / "train.jsonl").read_text().splitlines()
    common.prepare_task(TaskConfig(dir=str(task), arithmetic=SMALL))  # the same settings: kept
    assert "wrote the arithmetic task" in capsys.readouterr().out.split("\n")[0]
    assert "wrote" not in capsys.readouterr().out
    fewer = dataclasses.replace(SMALL, num_train=5)
    common.prepare_task(TaskConfig(dir=str(task), arithmetic=fewer))  # used to keep the old 8 rows
    assert "arithmetic.num_train: 8 -> 5" in capsys.readouterr().out
    assert len((task / "train.jsonl").read_text().splitlines()) == 5 != len(rows)

    users = tmp_path / "mine"
    users.mkdir()
    (users / "train.jsonl").write_text('{"prompt": "mine"}\n')
    common.prepare_task(TaskConfig(dir=str(users), arithmetic=fewer))  # not ours: used as it is
    assert (users / "train.jsonl").read_text() == '{"prompt": "mine"}\n'


def test_the_default_export_is_refused_before_any_work_when_a_user_added_a_file(tmp_path):
    from verl_trainer.utils.fs import replace_dir_atomically

    hf = tmp_path / "run" / "hf"
    replace_dir_atomically(hf, lambda tmp: (tmp / "model.safetensors").write_bytes(b"w"), "hf_export", "hf")
    assert common.final_export_dir(TrainerConfig(default_root_dir=str(tmp_path / "run"))) == str(hf)
    (hf / "notes.txt").write_text("mine")  # was deleted by the next run's export
    with pytest.raises(NotOwnedError, match=r"default_root_dir/hf=.*files it did not write \(notes.txt\)"):
        common.final_export_dir(TrainerConfig(default_root_dir=str(tmp_path / "run")))
    assert (hf / "notes.txt").read_text() == "mine"
