"""Two runs started at once in one directory: the second is refused, the first's checkpoints are whole.

Two real processes (1-rank fsdp2 SFT fits, CPU) share a ``default_root_dir``. Run A holds the checkpoint
directory's lock and waits inside its first step until the test lets it go; run B, started meanwhile, must
fail naming A's pid; A then finishes and its final checkpoint verifies and is ``"last"``. Before the lock,
both wrote into the directory and one committed a final checkpoint without ``engines/``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.trainer.common import tiny_model

ROOT = Path(__file__).resolve().parents[2]


def _main(model_path: str, root: str, gate: str) -> None:
    """One run; with ``gate``, it announces its first step and waits there for ``gate`` to appear."""
    from tests.trainer.common import SFTData, sft_module
    from verl_trainer import Trainer
    from verl_trainer.callbacks import Callback, ModelCheckpoint

    class Wait(Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if gate and trainer.global_step == 0:
                Path(gate + ".started").write_text(str(os.getpid()))
                deadline = time.monotonic() + 120
                while not Path(gate).exists() and time.monotonic() < deadline:
                    time.sleep(0.1)

    trainer = Trainer(strategy="fsdp2", devices=1, max_steps=2, default_root_dir=root, logger=False,
                      enable_progress_bar=False, seed=3,
                      callbacks=[Wait(), ModelCheckpoint(every_n_train_steps=1, keep_last_k=1)])
    trainer.fit(sft_module(model_path), SFTData(n=16, batch_size=4))


def _start(model_path: str, root: Path, gate: str) -> subprocess.Popen:
    code = (f"from tests.trainer.test_concurrent_runs import _main; "
            f"_main({model_path!r}, {str(root)!r}, {gate!r})")
    env = {**os.environ, "WANDB_MODE": "offline"}
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow  # two processes that each load torch and transformers: ~75 s on 2 busy cores
def test_a_second_run_in_the_same_directory_is_refused_while_the_first_runs(tmp_path):
    from verl_trainer.engine.checkpoint_dirs import find_last_checkpoint
    from verl_trainer.utils.manifest import verify_manifest

    model_path = tiny_model(tmp_path / "model")
    root, gate = tmp_path / "run", str(tmp_path / "gate")
    first = _start(model_path, root, gate)
    try:
        deadline = time.monotonic() + 180
        while not Path(gate + ".started").exists():
            assert first.poll() is None, first.communicate()[0]
            assert time.monotonic() < deadline, "run A never reached its first step"
            time.sleep(0.2)
        second = _start(model_path, root, "")
        out, _ = second.communicate(timeout=180)
        assert second.returncode != 0, out
        assert "is in use by another run" in out and f"pid {first.pid} " in out, out
        assert "DirectoryLockedError" in out and "another directory" in out
    finally:
        Path(gate).write_text("go")
        out, _ = first.communicate(timeout=180)
    assert first.returncode == 0, out
    last = find_last_checkpoint(root / "checkpoints")
    assert last is not None and last.name == "step_000002" and (last / "engines" / "actor").is_dir()
    verify_manifest(last)
    assert json.loads((last / "meta.json").read_text())["run_id"]
    assert not (root / "checkpoints" / ".verl_trainer.lock").exists()  # released at the end
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["step_000002"]


@pytest.mark.slow  # ~24 s: the recipe process imports torch and transformers
def test_a_recipe_is_refused_before_any_work_while_another_run_holds_its_directory(tmp_path):
    from tests.utils.test_dir_lock import HOLD

    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run" / "checkpoints")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        args = [sys.executable, str(ROOT / "recipes" / "sft.py"), f"task.dir={tmp_path / 'task'}",
                f"trainer.default_root_dir={tmp_path / 'run'}"]
        env = {**os.environ, "WANDB_MODE": "offline"}
        proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode != 0 and f"is in use by another run (pid {holder.pid} " in proc.stderr, proc.stderr
    assert not (tmp_path / "task").exists()  # refused before the task was written or a model loaded
