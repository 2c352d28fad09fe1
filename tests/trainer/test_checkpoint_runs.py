"""Checkpoint directories belong to one run; interrupted saves and deletions never block a resume.

One 1-rank run (fsdp2, CPU):

* run A saves steps 2 and 3 (``keep_last_k=2``); a fresh run B in the same directory is refused with
  the fix, and A's checkpoints stay;
* folders left by an interrupted save (``.step_N.tmp``) and an interrupted pruning (``.step_N.trash-*``)
  are removed, with a message, when A resumes with ``ckpt_path="last"``; A keeps its run id and prunes
  its own checkpoints;
* a save that fails with ``OSError(ENOSPC)`` half-way (the disk is full) leaves no folder behind, and
  the next ``ckpt_path="last"`` resumes from the previous checkpoint and finishes.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
from pathlib import Path

import pytest

from tests.trainer.common import SFTData, sft_module, tiny_model
from verl_trainer import Trainer
from verl_trainer.callbacks import ModelCheckpoint
from verl_trainer.testing.ranks import run_distributed


def _fit(model_path: str, root: Path, max_steps: int, ckpt_path: str | None = None) -> Trainer:
    trainer = Trainer(strategy="fsdp2", devices=1, max_steps=max_steps, default_root_dir=root, logger=False,
                      enable_progress_bar=False, seed=3,
                      callbacks=[ModelCheckpoint(every_n_train_steps=1, keep_last_k=2)])
    trainer.fit(sft_module(model_path), SFTData(n=32, batch_size=4), ckpt_path=ckpt_path)
    return trainer


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "checkpoints").iterdir())


def _run_id(ckpt: Path) -> str:
    return json.loads((ckpt / "meta.json").read_text())["run_id"]


def _runs(model_path: str, root: str) -> dict:
    """Runs in a fresh 1-rank process."""
    from verl_trainer.utils.fs import mark_owned

    out: dict = {}
    a = Path(root) / "a"
    _fit(model_path, a, 3)
    out["a_names"] = _names(a)
    run_a = _run_id(a / "checkpoints" / "step_000003")
    try:
        _fit(model_path, a, 5)
        out["fresh_error"] = None
    except FileExistsError as exc:
        out["fresh_error"] = str(exc)
    out["after_refusal"] = _names(a)

    half_written = a / "checkpoints" / ".step_000009.tmp"
    mark_owned(half_written, "checkpoint", run_id=run_a)
    (half_written / "rng_rank0.pt").write_bytes(b"half")
    half_deleted = a / "checkpoints" / ".step_000001.trash-0badc0de"
    mark_owned(half_deleted, "checkpoint", run_id=run_a)
    (half_deleted / "engines").mkdir()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        resumed = _fit(model_path, a, 5, ckpt_path="last")
    out["resumed_step"] = resumed.global_step
    out["resumed_names"] = _names(a)
    out["printed"] = printed.getvalue()
    out["same_run"] = _run_id(a / "checkpoints" / "step_000005") == run_a

    full = Path(root) / "full"
    original = Path.write_text

    def disk_full(self: Path, data: str, *args: object, **kwargs: object) -> int:
        if self.name == "meta.json" and self.parent.name.startswith(".step_000003.tmp"):
            original(self, data[: len(data) // 2], *args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return original(self, data, *args, **kwargs)

    Path.write_text = disk_full
    try:
        _fit(model_path, full, 3)
        out["disk_full_error"] = None
    except OSError as exc:
        out["disk_full_error"] = exc.errno
    finally:
        Path.write_text = original
    out["after_disk_full"] = _names(full)
    out["after_disk_full_step"] = _fit(model_path, full, 3, ckpt_path="last").global_step
    out["disk_full_resumed"] = _names(full)
    return out


@pytest.fixture(scope="module")
def outcome(tmp_path_factory) -> dict:
    model_path = tiny_model(tmp_path_factory.mktemp("model"))
    return run_distributed(_runs, 1, model_path, str(tmp_path_factory.mktemp("runs")), timeout=400,
                           env={"WANDB_MODE": "offline"})[0]


def test_a_fresh_run_is_refused_where_another_run_has_checkpoints(outcome):
    assert outcome["a_names"] == ["step_000002", "step_000003"]
    error = outcome["fresh_error"]
    assert error is not None and "holds checkpoints of another run" in error and "steps 2, 3" in error
    assert "ckpt_path='last'" in error and "another directory" in error
    assert outcome["after_refusal"] == ["step_000002", "step_000003"]  # nothing deleted


def test_resume_cleans_interrupted_folders_keeps_the_run_and_prunes_its_own(outcome):
    assert outcome["resumed_step"] == 5 and outcome["same_run"]
    assert outcome["resumed_names"] == ["step_000004", "step_000005"]
    assert "removed 2 folder(s) left by an interrupted checkpoint save or deletion" in outcome["printed"]
    assert ".step_000009.tmp" in outcome["printed"] and ".step_000001.trash-0badc0de" in outcome["printed"]


def test_a_save_failing_on_a_full_disk_does_not_block_the_next_resume(outcome):
    assert outcome["disk_full_error"] == errno.ENOSPC
    assert outcome["after_disk_full"] == ["step_000001", "step_000002"]  # no half-written folder left
    assert outcome["after_disk_full_step"] == 3
    assert outcome["disk_full_resumed"] == ["step_000002", "step_000003"]
