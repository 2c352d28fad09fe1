"""An engine checkpoint directory: marked as the project's, with a manifest; never over a user's files."""

from __future__ import annotations

import errno

import pytest

from verl_trainer.engine.checkpoint import atomic_checkpoint_dir, resolve_checkpoint_dir
from verl_trainer.utils.fs import NotOwnedError, read_marker
from verl_trainer.utils.manifest import MANIFEST_FILE


def test_commit_marks_the_directory_and_writes_its_manifest_last(tmp_path):
    with atomic_checkpoint_dir(tmp_path / "ckpt", run_id="r1") as tmp:
        (tmp / "weights.bin").write_bytes(b"w" * 100)
        assert not (tmp / MANIFEST_FILE).exists()
    assert read_marker(tmp_path / "ckpt")["run_id"] == "r1"
    assert (tmp_path / "ckpt" / MANIFEST_FILE).is_file()
    assert resolve_checkpoint_dir(tmp_path / "ckpt") == tmp_path / "ckpt"  # verified


def test_a_users_directory_is_never_replaced(tmp_path):
    users = tmp_path / "results"
    users.mkdir()
    (users / "paper.tex").write_text("precious")
    with pytest.raises(NotOwnedError, match=r"checkpoint path=.*results"):
        with atomic_checkpoint_dir(users):
            pass
    assert (users / "paper.tex").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]


def test_a_save_failing_on_a_full_disk_frees_its_space_and_keeps_the_previous(tmp_path):
    with atomic_checkpoint_dir(tmp_path / "ckpt") as tmp:
        (tmp / "weights.bin").write_bytes(b"good")
    with pytest.raises(OSError, match="No space"):
        with atomic_checkpoint_dir(tmp_path / "ckpt") as tmp:
            (tmp / "weights.bin").write_bytes(b"ha")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert (resolve_checkpoint_dir(tmp_path / "ckpt") / "weights.bin").read_bytes() == b"good"
