"""DeepSpeed's JIT-built op: a stale torch build lock is cleared or named at once; a first build is announced.

The op (``deepspeed_shm_comm`` on CPU) is built once in the session's own extensions directory (a real
build, minutes on a cold machine, unless an earlier DeepSpeed test built it) and copied into each test's
private ``TORCH_EXTENSIONS_DIR``, so the tests below do not compile it again; the one that needs a real
build of its own is ``slow``. Locks are planted as torch's ``FileBaton`` leaves them (an empty ``lock``
file); owners are real processes.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from tests.engine.common import build_engine, tiny_model
from verl_trainer.engine.deepspeed_ops import (
    BUILD_FLOCK,
    build_lock,
    extensions_root,
    inspect_build_lock,
    op_build_dir,
)
from verl_trainer.testing import run_distributed

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")

OP = "deepspeed_shm_comm"
BUILD_OP = (
    "import os; os.environ.setdefault('DS_ACCELERATOR', 'cpu')\n"
    "from deepspeed.accelerator import get_accelerator\n"
    "from verl_trainer.engine.deepspeed_ops import prepare_deepspeed_ops\n"
    "prepare_deepspeed_ops(get_accelerator())\n"
)


@pytest.fixture(scope="module")
def built_op() -> Path:
    """The op's build directory in the session's extensions root, built there if it is not yet."""
    subprocess.run([sys.executable, "-c", BUILD_OP], check=True, timeout=900, capture_output=True)
    op_dir = op_build_dir(OP)
    assert (op_dir / f"{OP}.so").exists()
    return op_dir


def _private_root(built_op: Path, tmp_path: Path) -> Path:
    """A TORCH_EXTENSIONS_DIR holding a copy of the built op (times kept: ninja finds it up to date)."""
    root = tmp_path / "torch_extensions"
    shutil.copytree(built_op, root / OP, ignore=shutil.ignore_patterns("lock", BUILD_FLOCK))
    return root


def _start_engine(model_path: str) -> list[str]:
    """Build an inference-only ZeRO-2 engine; the warnings rank 0 printed."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_engine("deepspeed_stage_2", "language_model", model_path, None, micro_batch_size_per_gpu=2)
    return [str(w.message) for w in caught]


def _hold_open(lock: Path) -> subprocess.Popen:
    """A process that creates ``lock`` as torch's FileBaton does and keeps it open (a build in progress)."""
    code = (f"import os, sys, time; fd = os.open({str(lock)!r}, os.O_CREAT | os.O_EXCL); "
            "print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_extensions_root_is_torchs(tmp_path, monkeypatch):
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # torch's default root, made here
    assert Path(_get_build_directory("x_probe", False)).parent == extensions_root()
    assert extensions_root().is_relative_to(tmp_path / "cache")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert Path(_get_build_directory("x_probe", False)) == op_build_dir("x_probe") == tmp_path / "x_probe"


def test_lock_held_open_is_a_build_and_its_killed_owners_lock_is_stale(tmp_path):
    op_dir = tmp_path / OP
    op_dir.mkdir()
    assert inspect_build_lock(op_dir).state == "absent"
    owner = _hold_open(op_dir / "lock")
    try:
        with build_lock(op_dir):
            found = inspect_build_lock(op_dir, clear=True)
        assert found.state == "building"
        assert [pid for pid, _ in found.owners] == [owner.pid]
        assert (op_dir / "lock").exists()  # a live owner's lock is never removed
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    with build_lock(op_dir):
        assert inspect_build_lock(op_dir, clear=True).state == "stale"
    assert not (op_dir / "lock").exists()


def test_a_process_inside_the_directory_makes_the_lock_unproven(tmp_path):
    op_dir = tmp_path / OP
    op_dir.mkdir()
    (op_dir / "lock").touch()
    child = subprocess.Popen(["sleep", "600"], cwd=op_dir)  # a killed build's orphaned ninja, say
    try:
        found = inspect_build_lock(op_dir, clear=True)
    finally:
        child.kill()
        child.wait()
    assert found.state == "unproven" and f"pid {child.pid}: sleep 600" in found.reason
    assert (op_dir / "lock").exists()


def test_stale_lock_is_cleared_and_two_ranks_start(built_op, tmp_path):
    root = _private_root(built_op, tmp_path)
    lock = root / OP / "lock"
    lock.touch()  # left by a build killed mid-way: nobody holds it
    so_time = (root / OP / f"{OP}.so").stat().st_mtime_ns
    model = tiny_model(str(tmp_path / "model"))
    start = time.monotonic()
    said = run_distributed(_start_engine, 2, model, timeout=120,
                           env={"TORCH_EXTENSIONS_DIR": str(root), "DS_ACCELERATOR": "cpu"})
    assert time.monotonic() - start < 120
    assert not lock.exists()
    assert (root / OP / f"{OP}.so").stat().st_mtime_ns == so_time  # loaded, not rebuilt
    stale = [m for m in said[0] if "removed a stale build lock" in m]
    assert len(stale) == 1 and str(lock) in stale[0]
    assert not any("removed a stale build lock" in m for m in said[1])  # said once, by rank 0
    assert not any("compiles its C++ op" in m for m in said[0])  # built already: nothing announced


def _start_engine_expecting_failure(model_path: str) -> tuple[str, float, str]:
    """Build the engine: ``(error type, seconds from the start to the error, message)``; starting fails."""
    from verl_trainer.engine.deepspeed_ops import StaleBuildLockError

    start = time.monotonic()
    try:
        _start_engine(model_path)
    except StaleBuildLockError as exc:
        return type(exc).__name__, time.monotonic() - start, str(exc)
    raise AssertionError("the engine started despite an unproven build lock")


def test_unproven_lock_fails_every_rank_at_once_naming_it(built_op, tmp_path):
    root = _private_root(built_op, tmp_path)
    lock = root / OP / "lock"
    lock.touch()
    squatter = subprocess.Popen(["sleep", "600"], cwd=root / OP)
    model = tiny_model(str(tmp_path / "model"))
    try:  # a rank left waiting (in torch's lock or a collective) would time the run out
        ranks = run_distributed(_start_engine_expecting_failure, 2, model, timeout=120,
                                env={"TORCH_EXTENSIONS_DIR": str(root), "DS_ACCELERATOR": "cpu"})
    finally:
        squatter.kill()
        squatter.wait()
    for kind, seconds, message in ranks:  # every rank raised, with every rank's finding
        assert kind == "StaleBuildLockError" and seconds < 10, (kind, seconds)
        assert f"`rm {lock}`" in message and f"pid {squatter.pid}: sleep 600" in message
        assert message.startswith("rank 0: ") and "\nrank 1: " in message
    assert lock.exists()  # not ours to delete


_HOLD_UNTIL_WAITED_FOR = """
import fcntl, os, sys, time
lock, flock = sys.argv[1], sys.argv[2]
fd = os.open(lock, os.O_CREAT | os.O_EXCL)  # as torch's FileBaton.try_acquire
print("held", flush=True)
busy_since, deadline = None, time.monotonic() + 90
while time.monotonic() < deadline:  # until a rank has held the build lock for 2 s: it waits for this lock
    probe = os.open(flock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        busy_since = None
    except BlockingIOError:
        busy_since = busy_since or time.monotonic()
        if time.monotonic() - busy_since > 2.0:
            break
    finally:
        os.close(probe)
    time.sleep(0.1)
os.close(fd)
os.remove(lock)  # as FileBaton.release
"""


def test_a_build_in_progress_is_waited_for_and_named(built_op, tmp_path):
    root = _private_root(built_op, tmp_path)
    lock = root / OP / "lock"
    builder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_UNTIL_WAITED_FOR, str(lock), str(root / OP / BUILD_FLOCK)],
        stdout=subprocess.PIPE, text=True)
    assert builder.stdout.readline().strip() == "held"
    model = tiny_model(str(tmp_path / "model"))
    try:
        said = run_distributed(_start_engine, 2, model, timeout=120,
                               env={"TORCH_EXTENSIONS_DIR": str(root), "DS_ACCELERATOR": "cpu"})
        assert builder.wait(timeout=10) == 0  # released its lock itself, after a rank waited for it
    finally:
        builder.kill()
        builder.wait()
    waiting = [m for m in said[0] if "is being built by another process" in m]
    assert len(waiting) == 1 and f"pid {builder.pid}: " in waiting[0] and str(lock) in waiting[0]


def _record_announcement(model_path: str, op_dir: str) -> list[tuple[str, bool]]:
    """Start an engine; each rank-0 warning with whether the op's .so existed when it was issued."""
    so = Path(op_dir) / f"{OP}.so"
    seen: list[tuple[str, bool]] = []

    def show(message, *args, **kwargs):
        seen.append((str(message), so.exists()))

    with warnings.catch_warnings():  # restores showwarning
        warnings.simplefilter("always")
        warnings.showwarning = show
        build_engine("deepspeed_stage_2", "language_model", model_path, None, micro_batch_size_per_gpu=2)
    return seen


@pytest.mark.slow
def test_first_build_is_announced_on_rank_0_before_it_starts(tmp_path):
    root = tmp_path / "torch_extensions"
    model = tiny_model(str(tmp_path / "model"))
    seen = run_distributed(_record_announcement, 2, model, str(root / OP), timeout=900,
                           env={"TORCH_EXTENSIONS_DIR": str(root), "DS_ACCELERATOR": "cpu"})
    announced = [(m, existed) for m, existed in seen[0] if "compiles its C++ op" in m]
    assert len(announced) == 1
    message, existed = announced[0]
    assert f"'{OP}' now, into {socket.gethostname()}:{root / OP} " in message and not existed
    assert not any("compiles its C++ op" in m for m, _ in seen[1])
    assert (root / OP / f"{OP}.so").exists() and not (root / OP / "lock").exists()
    assert os.listdir(root) == [OP]  # the only op built
