"""The sandbox: limits on time, memory, output; no network; a temporary directory that is removed."""

from __future__ import annotations

import os
import sys
import time

import pytest

from verl_trainer.rewards.sandbox import SandboxLimits, network_isolation, run_python


def test_runs_a_program_with_its_stdin_in_a_temp_dir_that_is_removed():
    result = run_python("import os\nprint(input()[::-1])\nprint(os.getcwd())", "hello")
    assert result.ok and result.stdout.splitlines()[0] == "olleh"
    workdir = result.stdout.splitlines()[1]
    assert "verl_sandbox_" in workdir and not os.path.exists(workdir)


def test_time_limit_kills_the_process_group():
    code = ("import subprocess, sys\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print(child.pid, flush=True)\n"
            "while True: pass")
    result = run_python(code, limits=SandboxLimits(timeout_s=2.0))
    assert result.timed_out and not result.ok and result.duration_s < 30
    grandchild = int(result.stdout.split()[0])
    for _ in range(50):  # killed with its group; reaped by init shortly after
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the sandboxed program's child {grandchild} survived the time limit")


def test_memory_and_cpu_limits():
    result = run_python("x = bytearray(512 * 1024 ** 2)", limits=SandboxLimits(memory_mb=128))
    assert result.returncode != 0 and "MemoryError" in result.stderr
    burn = run_python("while True: pass", limits=SandboxLimits(timeout_s=20, cpu_s=1))
    assert not burn.timed_out and burn.returncode != 0 and burn.duration_s < 15  # SIGXCPU, not the clock


def test_output_is_capped():
    result = run_python("import sys\nwhile True: sys.stdout.write('x' * 65536)",
                        limits=SandboxLimits(timeout_s=20, max_file_mb=1, max_output_bytes=1000))
    assert result.returncode != 0 and len(result.stdout) == 1000 and not result.timed_out


def test_no_network():
    result = run_python("import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('127.0.0.1', 9))")
    assert result.returncode != 0
    assert ("Network is unreachable" in result.stderr if network_isolation() == "namespace"
            else "network access is disabled" in result.stderr)
    assert result.network == network_isolation()


def test_environment_is_minimal():
    os.environ["VERL_SANDBOX_SECRET"] = "x"
    try:
        result = run_python("import os, sys\nprint(sorted(os.environ))\nprint(sys.flags.isolated)")
    finally:
        del os.environ["VERL_SANDBOX_SECRET"]
    assert "VERL_SANDBOX_SECRET" not in result.stdout and result.stdout.splitlines()[1] == "1"
    assert sys.executable


def test_bad_limits():
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        SandboxLimits(timeout_s=0)
