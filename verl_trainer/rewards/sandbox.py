"""Run untrusted Python code in a subprocess with CPU, memory, time and output limits, no network, a temp dir.

The one sandbox of the project (code-execution rewards use it; tools can): :func:`run_python` writes the
code into a fresh temporary directory, runs ``python -I`` there (isolated mode: no user site, no
``PYTHON*`` variables) with a minimal environment, and removes the directory afterwards. Limits
(:class:`SandboxLimits`) are set in the child before it starts (``setrlimit``): address space
(``memory_mb``), CPU seconds, file size, open files; the wall-clock ``timeout_s`` kills the child's whole
process group. **Network**: the child runs in its own empty network namespace (``unshare -rn``: not even
loopback) when the kernel allows unprivileged user namespaces; otherwise the socket module is disabled
inside the interpreter before the code runs (``SandboxResult.network``: ``"namespace"`` or ``"python"`` —
the latter stops ordinary code, not code that loads ``ctypes`` on purpose).
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SandboxLimits", "SandboxResult", "network_isolation", "run_python"]

_NO_SOCKETS = """\
import socket as _s
def _blocked(*a, **k):
    raise OSError("network access is disabled in the sandbox")
_s.socket = _s.create_connection = _s.socketpair = _s.getaddrinfo = _blocked
del _s, _blocked
"""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run.

    Attributes:
        timeout_s: Wall-clock seconds before the process group is killed.
        memory_mb: Address-space limit (``RLIMIT_AS``) in MiB.
        cpu_s: CPU seconds (``RLIMIT_CPU``); ``None``: ``ceil(timeout_s) + 1``.
        max_output_bytes: stdout / stderr kept (each); the rest is cut.
        max_file_mb: Largest file the code may write (``RLIMIT_FSIZE``).
    """

    timeout_s: float = 10.0
    memory_mb: int = 1024
    cpu_s: int | None = None
    max_output_bytes: int = 1 << 20
    max_file_mb: int = 16

    def __post_init__(self) -> None:
        if not self.timeout_s > 0 or self.memory_mb < 16 or (self.cpu_s is not None and self.cpu_s < 1):
            raise ValueError(f"sandbox limits {self}: timeout_s must be > 0, memory_mb >= 16, cpu_s >= 1")


@dataclass
class SandboxResult:
    """What a sandboxed run did.

    Attributes:
        returncode: The exit status (negative: killed by that signal).
        stdout: Its standard output (cut at ``max_output_bytes``).
        stderr: Its standard error (cut likewise).
        timed_out: It ran past ``timeout_s`` and was killed.
        duration_s: Wall-clock seconds.
        network: How the network was cut: ``"namespace"`` or ``"python"``.
    """

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float
    network: str

    @property
    def ok(self) -> bool:
        """Exited 0 within the time limit."""
        return self.returncode == 0 and not self.timed_out


@functools.cache
def network_isolation() -> str:
    """``"namespace"`` when ``unshare -rn`` works here (checked once), else ``"python"``."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return "python"
    try:
        done = subprocess.run([unshare, "-rn", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "python"
    return "namespace" if done.returncode == 0 else "python"


def _limit(limits: SandboxLimits) -> None:
    """In the child, before ``exec``: resource limits (the new session is ``start_new_session``)."""
    memory = limits.memory_mb << 20
    cpu = limits.cpu_s if limits.cpu_s is not None else int(limits.timeout_s) + 2
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.max_file_mb << 20, limits.max_file_mb << 20))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_python(code: str, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` as a Python program in the sandbox (see the module docstring).

    Args:
        code: The program's source.
        stdin: Its standard input.
        limits: The limits (default :class:`SandboxLimits`).

    Returns:
        The :class:`SandboxResult`.
    """
    limits = limits or SandboxLimits()
    network = network_isolation()
    with tempfile.TemporaryDirectory(prefix="verl_sandbox_") as tmp:
        program = Path(tmp) / "main.py"
        program.write_text(code if network == "namespace" else _NO_SOCKETS + code, encoding="utf-8")
        argv = [sys.executable, "-I", "-B", str(program)]
        if network == "namespace":
            argv = [shutil.which("unshare") or "unshare", "-rn", *argv]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8",
               "PYTHONIOENCODING": "utf-8"}
        started = time.monotonic()
        # output goes to files in the sandbox directory, so RLIMIT_FSIZE caps it (a pipe would not)
        with open(Path(tmp) / ".stdout", "w+b") as out, open(Path(tmp) / ".stderr", "w+b") as err:
            process = subprocess.Popen(argv, cwd=tmp, env=env, stdin=subprocess.PIPE, stdout=out, stderr=err,
                                       start_new_session=True, preexec_fn=functools.partial(_limit, limits))
            timed_out = False
            try:
                process.communicate(stdin.encode("utf-8"), timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            except BrokenPipeError:  # it exited without reading all of stdin
                process.wait()
            duration = time.monotonic() - started
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(limits.max_output_bytes), err.read(limits.max_output_bytes)
        return SandboxResult(process.returncode, stdout.decode("utf-8", errors="replace"),
                             stderr.decode("utf-8", errors="replace"), timed_out, duration, network)
