"""The directory lock: exclusive between real processes, released by death, a stale holder reported."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from verl_trainer.utils.dir_lock import LOCK_FILE, DirectoryLock, DirectoryLockedError

HOLD = ("import sys, time; from verl_trainer.utils.dir_lock import DirectoryLock; "
        "DirectoryLock(sys.argv[1], run_id='run-a').acquire(); print('held', flush=True); time.sleep(120)")


def test_a_held_lock_refuses_others_and_a_killed_holder_is_reported_as_stale(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DirectoryLockedError, match=rf"in use by another run \(pid {holder.pid} on host "
                                                       r".*run id run-a.*another directory"):
            DirectoryLock(tmp_path, "checkpoint directory").acquire()
        with pytest.raises(DirectoryLockedError, match=rf"\(pid {holder.pid} on host .*run id run-a"):
            DirectoryLock(tmp_path, "checkpoint directory").ensure_free()  # the check that claims nothing
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    lock = DirectoryLock(tmp_path, "checkpoint directory").acquire()  # the kernel released the dead one's
    try:
        assert lock.stale is not None and lock.stale["pid"] == holder.pid and not lock.stale["alive"]
        assert f"stale lock left by pid {holder.pid}" in lock.stale_message()
        assert "no longer running" in lock.stale_message()
        inner = DirectoryLock(tmp_path).acquire()  # re-entrant within a process (a recipe, then its fit)
        assert inner.held and inner.stale is None
        inner.release()  # the outer holder still holds it
        assert (tmp_path / LOCK_FILE).is_file() and lock.held
    finally:
        lock.release()
    assert not (tmp_path / LOCK_FILE).exists()
    with DirectoryLock(tmp_path) as again:  # released cleanly: nothing stale
        assert again.held and again.stale is None


def test_the_free_check_writes_nothing(tmp_path):
    missing = tmp_path / "run" / "checkpoints"
    DirectoryLock(missing).ensure_free()  # no directory, no lock file: free, and nothing is created
    assert not (tmp_path / "run").exists()
    with DirectoryLock(tmp_path) as lock:  # held by this process: free for it (the lock is re-entrant)
        DirectoryLock(tmp_path).ensure_free()
        assert lock.held
    DirectoryLock(tmp_path).ensure_free()  # released: free again
    assert sorted(os.listdir(tmp_path)) == []
