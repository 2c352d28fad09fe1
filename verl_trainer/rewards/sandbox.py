"""Run model-written Python under a real isolation tool, with time, memory, process, disk and output limits.

The one sandbox of the project: code-execution rewards, the ``python`` tool and any user tool or
environment that runs programs call :func:`run_python`. The program runs under nsjail or bubblewrap
(:mod:`verl_trainer.rewards.jail`: which one, and the view of the machine it gives): it sees the
interpreter's files read-only and a private ``tmpfs`` ``/tmp``, has no network (UNIX path sockets
included), its own PID namespace (the trainer is not visible, so it cannot be signalled), uid 65534 with no
capabilities, and dies with the trainer. Every process it starts ends when the call ends (the PID
namespace's init is killed), whatever it did (``setsid``, double ``fork``).

Where no isolation tool can run, :func:`run_python` and :func:`check_sandbox` raise
:class:`~verl_trainer.rewards.jail.SandboxUnavailableError` naming the cause and the fix;
``VERL_SANDBOX=none`` is the explicit opt-in to an unconfined child (resource limits only), warned about
once per process. Clean-up never raises: the host side is one temporary directory the program cannot
write to (its output goes to files there through inherited descriptors, capped by ``RLIMIT_FSIZE``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import resource
import select
import shutil
import signal
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from verl_trainer.rewards.jail import (
    PROGRAM_DIR,
    Isolation,
    SandboxLimits,
    SandboxUnavailableError,
    candidates,
    cpu_seconds,
    interpreter,
    remove_stale_cgroups,
    requested_isolation,
    run_under,
    unavailable,
)

__all__ = ["SandboxLimits", "SandboxResult", "SandboxUnavailableError", "check_sandbox", "resolve_isolation",
           "run_python"]

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PRCTL = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
"""Looked up here, not in the forked child (no dynamic loading between ``fork`` and ``exec``); Linux only."""
_NSJAIL_GRACE_S = 2.0


@dataclass
class SandboxResult:
    """What a sandboxed run did.

    Attributes:
        returncode: The exit status (killed by a signal: negative under ``none``/bubblewrap, 128 + the
            signal under nsjail).
        stdout: Its standard output (cut at ``max_output_bytes``).
        stderr: Its standard error (cut likewise).
        timed_out: It ran past ``timeout_s`` and was killed.
        duration_s: Wall-clock seconds.
        isolation: The tool: ``nsjail+cgroup``, ``nsjail``, ``bwrap`` or ``none``.
        tool_log: What the isolation tool itself reported (empty when it had nothing to say).
    """

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float
    isolation: str
    tool_log: str = ""

    @property
    def ok(self) -> bool:
        """Exited 0 within the time limit."""
        return self.returncode == 0 and not self.timed_out


@functools.cache
def _warn_unconfined() -> None:
    message = ("VERL_SANDBOX=none: model-written code (code rewards, the python tool) runs UNCONFINED, with "
               "resource limits only: it can read and write what the trainer can, signal it and reach the "
               "network. Unset VERL_SANDBOX to run it under nsjail or bubblewrap")
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    logger.warning(message)


def _probe(isolation: Isolation) -> str | None:
    """Run a program under ``isolation``; ``None`` when it ran, else what went wrong."""
    try:
        result = run_python("print('ok')", limits=SandboxLimits(timeout_s=30), isolation=isolation)
    except OSError as err:
        return str(err)
    if result.ok and result.stdout.strip() == "ok":
        return None
    return (result.stderr or result.tool_log or f"exit status {result.returncode}").strip()[-300:]


@functools.cache
def _resolve(requested: str) -> Isolation:
    options, tried = candidates(requested)
    for option in options:
        if option.name == "none":
            return option
        problem = _probe(option)
        if problem is None:
            return option
        tried.append(f"{option.label} ({option.binary}): {problem}")
    raise unavailable(requested, tried)


def resolve_isolation() -> Isolation:
    """The isolation tool of this process (``VERL_SANDBOX``; each candidate probed once, then cached).

    Raises:
        ValueError: ``VERL_SANDBOX`` is not a known value.
        SandboxUnavailableError: No requested tool can run here (the cause and the fix named).
    """
    return _resolve(requested_isolation())


def check_sandbox() -> Isolation:
    """The isolation model-written code will run under; call before models load.

    Warns once per process under ``VERL_SANDBOX=none``.

    Raises:
        ValueError: ``VERL_SANDBOX`` is not a known value.
        SandboxUnavailableError: No isolation tool can run here (the cause and the fix named).
    """
    isolation = resolve_isolation()
    if isolation.name == "none":
        _warn_unconfined()
    return isolation


def _rlimits(limits: SandboxLimits) -> dict[int, int]:
    """The per-process limits (bubblewrap and ``none``; nsjail sets its own inside the jail)."""
    return {resource.RLIMIT_AS: limits.memory_mb << 20, resource.RLIMIT_CPU: cpu_seconds(limits),
            resource.RLIMIT_FSIZE: limits.max_file_mb << 20, resource.RLIMIT_NOFILE: 64,
            resource.RLIMIT_CORE: 0}


_PRLIMIT_FLAGS = {resource.RLIMIT_AS: "--as", resource.RLIMIT_CPU: "--cpu", resource.RLIMIT_FSIZE: "--fsize",
                  resource.RLIMIT_NOFILE: "--nofile", resource.RLIMIT_CORE: "--core"}


@functools.cache
def _util_linux() -> tuple[str, str] | None:
    setpriv, prlimit = shutil.which("setpriv"), shutil.which("prlimit")
    return (setpriv, prlimit) if setpriv and prlimit else None


def _launcher(limits: SandboxLimits, isolation: Isolation) -> list[str] | None:
    """``setpriv --pdeathsig KILL -- [prlimit ... --]``, or ``None`` where util-linux's tools are missing.

    The child dies with the calling thread and gets its limits through these tools exec'd in front of it.
    A ``preexec_fn`` would do the same but makes ``subprocess`` fork the whole trainer instead of
    ``vfork``, which costs more per call the larger the trainer process.
    """
    tools = _util_linux()
    if tools is None:
        return None
    prefix = [tools[0], "--pdeathsig", "KILL", "--"]
    if isolation.name != "nsjail":
        prefix += [tools[1], *(f"{_PRLIMIT_FLAGS[k]}={v}" for k, v in _rlimits(limits).items()), "--"]
    return prefix


def _child_setup(limits: SandboxLimits, isolation: Isolation) -> None:
    """The :func:`_launcher` fallback, in the child before ``exec``."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if isolation.name != "nsjail":
        for kind, value in _rlimits(limits).items():
            resource.setrlimit(kind, (value, value))


def _read(path: Path, limit: int) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", errors="replace")
    except OSError:
        return ""


def _kill(process: subprocess.Popen, isolation: Isolation) -> None:
    """End a run: nsjail gets SIGTERM first (it kills the jail and removes its cgroup), then SIGKILL."""
    if isolation.name == "nsjail":
        process.terminate()
        try:
            process.wait(_NSJAIL_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()
    if isolation.cgroup:
        remove_stale_cgroups()


def _wait(process: subprocess.Popen, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for ``process`` to exit; ``True`` when it did.

    Waits on a pidfd (Linux 5.3+), which wakes at the exit; ``Popen.wait(timeout)`` polls with sleeps of up
    to 50 ms.
    """
    try:
        pidfd = os.pidfd_open(process.pid)
    except (AttributeError, OSError):
        try:
            process.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        exited = bool(poller.poll(timeout_s * 1000))
    finally:
        os.close(pidfd)
    if exited:
        process.wait()
    return exited


def run_python(code: str, stdin: str = "", limits: SandboxLimits | None = None,
               isolation: Isolation | None = None) -> SandboxResult:
    """Run ``code`` as a Python program in the sandbox (see the module docstring).

    Args:
        code: The program's source (run as ``python -I -B main.py`` by the base interpreter).
        stdin: Its standard input.
        limits: The limits (default :class:`SandboxLimits`).
        isolation: The tool (default: :func:`check_sandbox`'s).

    Returns:
        The :class:`SandboxResult`.

    Raises:
        SandboxUnavailableError: No isolation tool can run here and ``VERL_SANDBOX=none`` is not set.
    """
    limits = limits or SandboxLimits()
    isolation = isolation or check_sandbox()
    host = Path(tempfile.mkdtemp(prefix="verl_sandbox_"))
    try:
        program_dir = host / "program"  # the only host directory the program sees (read-only)
        program_dir.mkdir()
        (program_dir / "main.py").write_text(code, encoding="utf-8")
        (host / "stdin").write_bytes(stdin.encode("utf-8", errors="replace"))
        main = str(program_dir / "main.py") if isolation.name == "none" else f"{PROGRAM_DIR}/main.py"
        argv = run_under(isolation, [interpreter(), "-I", "-B", main], str(program_dir), limits,
                         str(host / "tool.log"))
        launcher = _launcher(limits, isolation)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(program_dir), "TMPDIR": str(program_dir),
               "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}  # what an unconfined child sees
        started = time.monotonic()
        with open(host / "stdin", "rb") as inp, open(host / "stdout", "wb") as out, \
                open(host / "stderr", "wb") as err:
            process = subprocess.Popen(
                [*(launcher or []), *argv], cwd=program_dir, env=env, stdin=inp, stdout=out, stderr=err,
                start_new_session=True,
                preexec_fn=None if launcher else functools.partial(_child_setup, limits, isolation),
            )
            try:
                timed_out = not _wait(process, limits.timeout_s)
            finally:
                if process.returncode is None:
                    _kill(process, isolation)
        if isolation.name == "none":
            _kill_group_left(process.pid)
        return SandboxResult(
            returncode=process.returncode,
            stdout=_read(host / "stdout", limits.max_output_bytes),
            stderr=_read(host / "stderr", limits.max_output_bytes),
            timed_out=timed_out,
            duration_s=time.monotonic() - started,
            isolation=isolation.label,
            tool_log=_read(host / "tool.log", 1 << 14),
        )
    finally:
        shutil.rmtree(host, ignore_errors=True)


def _kill_group_left(pgid: int) -> None:
    """Unconfined runs: kill what is left of the program's process group (a daemon can still escape)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
