"""A bad setting on the command line ends the run with its message alone (issue 47 item 7).

As a user meets it: ``python recipes/<name>.py`` / ``python -m verl_trainer <name>`` with a bad value, run
as a subprocess; stderr is the message and a hint, no traceback, exit status 1. ``VERL_TRAINER_DEBUG=1``
shows the traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("VERL_TRAINER_DEBUG", "HYDRA_FULL_ERROR")}
    args = [sys.executable, *args, f"trainer.default_root_dir={tmp_path / 'run'}"]
    return subprocess.run(args, cwd=tmp_path, env={**clean, "WANDB_MODE": "offline", **env},
                          capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize(
    ("command", "setting", "message"),
    [
        ([str(ROOT / "recipes" / "grpo.py")], "trainer.val_check_interval=2.5",  # raised inside Trainer(...)
         "grpo.py: error: val_check_interval=2.5; use an int >= 1"),
        (["-m", "verl_trainer", "sft"], "model.path=/nonexistent/model",  # raised by the model checks
         "verl-trainer sft: error: model.path='/nonexistent/model' does not exist"),
    ],
    ids=["trainer-value", "missing-model"],
)
def test_a_bad_setting_prints_its_message_alone_and_fails(tmp_path, command, setting, message):
    proc = _run([*command, setting], tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith(message), proc.stderr
    assert lines[1:] == ["(set VERL_TRAINER_DEBUG=1 for the traceback)"], proc.stderr


def test_the_debug_setting_shows_the_traceback(tmp_path):
    proc = _run([str(ROOT / "recipes" / "grpo.py"), "trainer.val_check_interval=2.5"], tmp_path,
                VERL_TRAINER_DEBUG="1")
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr and "arguments.py" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("ValueError: val_check_interval=2.5"), proc.stderr
