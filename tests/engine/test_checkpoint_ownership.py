"""An engine checkpoint directory: marked as the project's, with a manifest; never over a user's files."""

from __future__ import annotations

import errno
import subprocess

import pytest
import torch

from verl_trainer.engine.checkpoint import atomic_checkpoint_dir, resolve_checkpoint_dir
from verl_trainer.utils.disk_full import DiskFullError
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
    with pytest.raises(DiskFullError, match=r"no space left on .*ckpt while writing the checkpoint") as info:
        with atomic_checkpoint_dir(tmp_path / "ckpt") as tmp:
            (tmp / "weights.bin").write_bytes(b"ha")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert info.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert (resolve_checkpoint_dir(tmp_path / "ckpt") / "weights.bin").read_bytes() == b"good"


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 256 KiB tmpfs (needs permission to mount; skipped where there is none)."""
    mount = tmp_path / "small"
    mount.mkdir()
    command = ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)]
    proc = subprocess.run(command, capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "--lazy", str(mount)], check=True)  # torch may still hold the failed file


def test_torch_save_on_a_really_full_disk_says_no_space_left_naming_the_path(small_tmpfs):
    with atomic_checkpoint_dir(small_tmpfs / "ckpt") as tmp:
        torch.save({"w": torch.zeros(8)}, tmp / "small.pt")
    message = r"no space left on .*small/ckpt while writing the checkpoint \(\d+ bytes free"
    with pytest.raises(DiskFullError, match=message):  # torch itself says "enforce fail at inline_container"
        with atomic_checkpoint_dir(small_tmpfs / "ckpt") as tmp:
            torch.save({"w": torch.zeros(1 << 17)}, tmp / "big.pt")  # 512 KiB
    assert sorted(p.name for p in small_tmpfs.iterdir()) == ["ckpt"]  # the space was freed
    assert (small_tmpfs / "ckpt" / "small.pt").is_file()


def test_a_temporary_directory_taken_over_by_another_save_is_not_committed(tmp_path):
    from verl_trainer.utils.fs import mark_owned

    with pytest.raises(RuntimeError, match=r"\.ckpt\.tmp-run-a' is no longer this save's .* another process"):
        with atomic_checkpoint_dir(tmp_path / "ckpt", run_id="run-a") as tmp:
            assert tmp.name == ".ckpt.tmp-run-a"  # the run id in the temporary name
            (tmp / "weights.bin").write_bytes(b"a")
            mark_owned(tmp, "checkpoint", run_id="run-a", save="another save's token")  # a second writer
    assert not (tmp_path / "ckpt").exists()
