"""The sandbox's basics: stdin and stdout, the CPU limit, the host temporary directory removed, bad limits.
Hostile programs (files, processes, memory, disk, network): tests/rewards/test_sandbox_hostile.py."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from verl_trainer.rewards.sandbox import SandboxLimits, run_python


def test_runs_a_program_with_its_stdin_and_removes_its_host_directory():
    tmp = Path(tempfile.gettempdir())
    before = set(tmp.glob("verl_sandbox_*"))
    result = run_python("import os\nprint(input()[::-1])\nprint(os.getcwd())", "hello")
    assert result.ok and result.stdout.splitlines() == ["olleh", "/tmp"]
    assert set(tmp.glob("verl_sandbox_*")) <= before


def test_cpu_limit_is_per_process_cpu_time_not_the_clock():
    burn = run_python("while True: pass", limits=SandboxLimits(timeout_s=20, cpu_s=1))
    assert not burn.timed_out and burn.returncode != 0 and burn.duration_s < 15  # SIGXCPU, not the clock


def test_environment_is_minimal():
    os.environ["VERL_SANDBOX_SECRET"] = "x"
    try:
        result = run_python("import os, sys\nprint(sorted(os.environ))\nprint(sys.flags.isolated)")
    finally:
        del os.environ["VERL_SANDBOX_SECRET"]
    assert "VERL_SANDBOX_SECRET" not in result.stdout and result.stdout.splitlines()[1] == "1"


def test_bad_limits():
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError, match="max_processes >= 1"):
        SandboxLimits(max_processes=0)


def test_without_util_linux_the_child_sets_its_own_limits(monkeypatch):
    from verl_trainer.rewards import sandbox
    from verl_trainer.rewards.jail import Isolation, candidates

    monkeypatch.setattr(sandbox, "_util_linux", lambda: None)
    for isolation in [*candidates("auto")[0], Isolation("none")]:
        result = run_python("x = bytearray(512 << 20)", "", SandboxLimits(memory_mb=128), isolation)
        assert result.returncode != 0 and "MemoryError" in result.stderr, (isolation, result)
