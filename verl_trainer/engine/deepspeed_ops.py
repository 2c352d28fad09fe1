"""DeepSpeed's JIT-built ops: announced before they compile, and never stuck behind a stale build lock.

On CPU ``deepspeed.initialize`` builds ``deepspeed_shm_comm`` the first time it runs with a given torch and
Python, into :func:`extensions_root`'s ``<op>/`` under torch's ``FileBaton`` (the file ``<op dir>/lock``),
which a killed build leaves behind for every later load to wait on. :func:`prepare_deepspeed_ops` runs on
every rank before ``deepspeed.initialize`` and loads each such op itself (DeepSpeed's later load returns the
cached module):

1. rank 0 warns before a first build, naming the op and each host and directory where it is missing;
2. each rank inspects ``<op dir>/lock`` (:func:`inspect_build_lock`) while holding the project's build lock
   (:func:`build_lock`); if any rank found a lock it cannot prove stale, every rank raises
   :class:`StaleBuildLockError` together, naming the file and the fix;
3. each rank loads the op while holding the build lock (the first builds, the others find it built).

A ``lock`` is **stale** when (a) this process holds the project's build lock, (b) no live process has the
lock file open (by device and inode, in ``/proc/<pid>/fd``) and (c) no live process has its working
directory inside the op directory; it is then removed and reported on rank 0. A lock held open is a build in
progress (rank 0 names its pid, torch waits). It is **unproven** when (c) fails, ``/proc`` is missing, or a
process of the lock's owner cannot be inspected. Processes in another PID namespace or on another host are
not seen. The reasons and the tests: docs/reliability.md, "A killed DeepSpeed op build never blocks later
runs".
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from verl_trainer.utils.distributed import all_gather_object, get_rank

if TYPE_CHECKING:
    from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator
    from deepspeed.ops.op_builder.builder import OpBuilder

__all__ = [
    "BUILD_FLOCK",
    "JIT_OPS",
    "BuildLockState",
    "StaleBuildLockError",
    "build_lock",
    "extensions_root",
    "inspect_build_lock",
    "op_build_dir",
    "prepare_deepspeed_ops",
]

JIT_OPS = ("ShareMemCommBuilder",)  # the op builders deepspeed.initialize loads for this engine
BUILD_FLOCK = ".verl_trainer_build.flock"
_BATON = "lock"  # torch.utils.file_baton.FileBaton's file in the op directory
_FLOCK_PROBE_S = 1.0  # how long step 2 waits for the build lock before calling it busy


class StaleBuildLockError(RuntimeError):
    """torch's build lock of a DeepSpeed op has no owner this process can see, but is not proven stale."""


@dataclass
class BuildLockState:
    """What :func:`inspect_build_lock` found for one op directory.

    Attributes:
        path: torch's lock file, ``<op dir>/lock``.
        state: ``"absent"``; ``"building"`` (a live process holds it open: ``owners``); ``"stale"``
            (provably ownerless); ``"unproven"`` (no owner seen, but not provably stale: ``reason``);
            ``"busy"`` (another verl-trainer process holds the build lock; not inspected).
        owners: ``(pid, command)`` of the processes holding the lock open.
        reason: Why an ``"unproven"`` lock is not provably stale.
    """

    path: Path
    state: Literal["absent", "building", "stale", "unproven", "busy"]
    owners: list[tuple[int, str]] = field(default_factory=list)
    reason: str = ""


def extensions_root() -> Path:
    """The directory torch builds JIT extensions under: ``$TORCH_EXTENSIONS_DIR``, else its default.

    The default is ``torch.utils.cpp_extension.get_default_build_root()/py<maj><min><abiflags>_<accel>``
    (``accel``: ``rocm<ver>``, ``cu<ver>`` or ``cpu``), torch's own rule for ``load``.
    """
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is not None:
        return Path(root)
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accel = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accel = "cu" + torch.version.cuda.replace(".", "")
    else:
        accel = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accel}"


def op_build_dir(name: str) -> Path:
    """The directory torch builds the extension ``name`` in (not created)."""
    return extensions_root() / name


def _command(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:200] or "?"


def _uid(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[2])  # effective uid
    except (OSError, ValueError, IndexError):
        return None
    return None


def _scan(lock: Path, op_dir: Path) -> tuple[list[int], list[int], list[int], tuple[int, int]]:
    """Look for the lock's owners in ``/proc``.

    Returns:
        ``(pids holding lock open, pids with their cwd inside op_dir, the lock owner's pids not readable,
        the lock's (device, inode))``.
    """
    st = lock.stat()
    target = (st.st_dev, st.st_ino)
    op_real = os.path.realpath(op_dir)
    holders, inside, hidden = [], [], []
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except FileNotFoundError:  # ended while we looked
            continue
        except PermissionError:
            if _uid(pid) == st.st_uid:
                hidden.append(pid)
            continue
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:  # ended, or not readable (criterion (c) is best effort: see the module docstring)
            cwd = ""
        if cwd == op_real or cwd.startswith(op_real + os.sep):
            inside.append(pid)
        for fd in fds:
            try:
                fst = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if (fst.st_dev, fst.st_ino) == target:
                holders.append(pid)
                break
    return holders, inside, hidden, target


def inspect_build_lock(op_dir: str | os.PathLike, clear: bool = False) -> BuildLockState:
    """Classify ``<op_dir>/lock`` by the module docstring's criterion; the caller holds :func:`build_lock`.

    Args:
        op_dir: An op's build directory (:func:`op_build_dir`).
        clear: Remove a lock found ``"stale"`` (the returned state stays ``"stale"``).

    Returns:
        The :class:`BuildLockState`.
    """
    op_dir = Path(op_dir)
    lock = op_dir / _BATON
    if not lock.exists():
        return BuildLockState(lock, "absent")
    if not os.path.isdir("/proc"):
        return BuildLockState(lock, "unproven", reason="there is no /proc to look for its owner")
    try:
        holders, inside, hidden, scanned = _scan(lock, op_dir)
    except FileNotFoundError:  # released while we looked
        return BuildLockState(lock, "absent")
    if holders:
        return BuildLockState(lock, "building", owners=[(p, _command(p)) for p in holders])
    if inside:
        listed = "; ".join(f"pid {p}: {_command(p)}" for p in inside)
        return BuildLockState(lock, "unproven", reason=(
            f"no process holds it open, but processes still run inside {str(op_dir)!r} (a killed build's "
            f"compilers?): {listed}"))
    if hidden:
        return BuildLockState(lock, "unproven", reason=(
            f"processes {hidden} of the lock file's owner (uid {lock.stat().st_uid}) cannot be inspected "
            f"by this user"))
    if clear:
        with contextlib.suppress(FileNotFoundError):
            now = lock.stat()
            if (now.st_dev, now.st_ino) == scanned:  # not a new build's lock, made since the scan
                lock.unlink()
    return BuildLockState(lock, "stale")


@contextlib.contextmanager
def build_lock(op_dir: str | os.PathLike, wait_s: float | None = None,
               on_wait: Callable[[], None] | None = None) -> Iterator[bool]:
    """Hold the project's build lock of ``op_dir``: ``fcntl.flock`` on ``<op_dir>/.verl_trainer_build.flock``.

    Args:
        op_dir: The op's build directory (created if missing).
        wait_s: Give up after this many seconds (``None``: wait as long as it takes).
        on_wait: Called once when the lock is not free at the first try (to say that this process waits).

    Yields:
        ``True`` when held; ``False`` when ``wait_s`` passed first (not held).
    """
    op_dir = Path(op_dir)
    op_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(op_dir / BUILD_FLOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = None if wait_s is None else time.monotonic() + wait_s
        held = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                if deadline is not None and time.monotonic() >= deadline:
                    break
                if on_wait is not None:
                    on_wait()
                    on_wait = None
                if deadline is None:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    held = True
                    break
                time.sleep(0.05)
        yield held
    finally:
        os.close(fd)  # releases the flock


def _fix(lock: Path) -> str:
    return (f"check that no DeepSpeed/torch extension build runs on this machine (e.g. `ps aux | grep -e "
            f"ninja -e deepspeed`), then `rm {lock}` and start again; or set TORCH_EXTENSIONS_DIR to a "
            f"directory of this run's own")


def _unproven_message(found: BuildLockState) -> str:
    return (f"torch's build lock {str(found.path)!r} of a DeepSpeed op has no live owner this process can "
            f"see, but it cannot be proven stale: {found.reason}. torch would wait for it forever. Fix: "
            f"{_fix(found.path)}")


def _jit_builders(accelerator: DeepSpeedAccelerator) -> list[OpBuilder]:
    """The op builders of :data:`JIT_OPS` that this process would JIT-build or load from a build directory."""
    import deepspeed.ops
    from deepspeed.git_version_info import accelerator_name, installed_ops

    out = []
    for class_name in JIT_OPS:
        builder = accelerator.create_op_builder(class_name)
        if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
            continue  # deepspeed does not load it either
        if builder.name in getattr(builder, "_loaded_ops", {}):
            continue  # loaded in this process already
        if installed_ops.get(builder.name, False) and accelerator_name == getattr(accelerator, "_name", None):
            continue  # pre-built into the deepspeed install: nothing is compiled
        out.append(builder)
    return out


def _load(builder: OpBuilder, op_dir: Path, rank: int) -> None:
    """Load one op while holding the build lock; a stale ``lock`` found here is cleared or raised."""
    def announce() -> None:
        if rank == 0:
            warnings.warn(f"waiting for another verl-trainer process that builds DeepSpeed's op "
                          f"{builder.name!r} in {str(op_dir)!r}", stacklevel=5)

    with build_lock(op_dir, on_wait=announce):
        found = inspect_build_lock(op_dir, clear=True)
        if found.state == "unproven":
            raise StaleBuildLockError(_unproven_message(found))
        builder.load(verbose=False)


def prepare_deepspeed_ops(accelerator: DeepSpeedAccelerator) -> list[str]:
    """Check, announce and load the ops ``deepspeed.initialize`` JIT-builds; a collective over all ranks.

    See the module docstring for the steps and the stale-lock criterion.

    Args:
        accelerator: ``deepspeed.accelerator.get_accelerator()``.

    Returns:
        The names of the ops loaded here (empty when none needs a JIT build or load).

    Raises:
        StaleBuildLockError: On every rank, when any rank found a build lock it cannot prove stale.
    """
    rank = get_rank()
    builders = _jit_builders(accelerator)
    report: list[tuple[str, str, str, str | None]] = []  # (op, state, message, where it will compile)
    for builder in builders:
        op_dir = op_build_dir(builder.name)
        built = any(op_dir.glob(f"{builder.name}*.so"))
        with build_lock(op_dir, wait_s=_FLOCK_PROBE_S) as held:
            busy = BuildLockState(op_dir / _BATON, "busy")
            found = inspect_build_lock(op_dir, clear=True) if held else busy
        message = ""
        if found.state == "unproven":
            message = _unproven_message(found)
        elif found.state == "stale":
            message = (f"removed a stale build lock of DeepSpeed's op {builder.name!r}: {str(found.path)!r} "
                       f"(no live process held it open or ran in its directory; a build was killed)")
        elif found.state == "building":
            owners = "; ".join(f"pid {p}: {cmd}" for p, cmd in found.owners)
            message = (f"DeepSpeed's op {builder.name!r} is being built by another process ({owners}); "
                       f"waiting for its lock {str(found.path)!r}")
        where = None if built else f"{socket.gethostname()}:{op_dir}"
        report.append((builder.name, found.state, message, where))
    everyone = all_gather_object((rank, report))
    errors = [f"rank {r}: {msg}" for r, ops in everyone for _, state, msg, _ in ops if state == "unproven"]
    if errors:
        raise StaleBuildLockError("\n".join(errors))
    if rank == 0:
        said = set()
        for _, ops in everyone:
            for _, state, message, _ in ops:
                if state in ("stale", "building") and message not in said:
                    said.add(message)
                    warnings.warn(message, stacklevel=2)
        for builder in builders:
            where = sorted({w for _, ops in everyone for name, _, _, w in ops if name == builder.name and w})
            if where:
                warnings.warn(
                    f"DeepSpeed compiles its C++ op {builder.name!r} now, into {', '.join(where)} (host:"
                    f"directory; the first DeepSpeed run with this torch and Python there: this takes "
                    f"minutes, later runs reuse it). Set TORCH_EXTENSIONS_DIR to build elsewhere.",
                    stacklevel=2)
    for builder in builders:
        _load(builder, op_build_dir(builder.name), rank)
    return [b.name for b in builders]
