"""The commands' CPU thread defaults (verl_trainer/utils/threads.py), checked in real processes.

libgomp prints the settings it loaded with under ``OMP_DISPLAY_ENV=VERBOSE``: ``GOMP_SPINCOUNT = '0'``
means it read ``OMP_WAIT_POLICY=PASSIVE`` (its default spins 300000 times, ``ACTIVE`` 3e10).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_trainer.utils.threads import apply_thread_env_defaults, available_cpus, intra_op_threads

REPO = Path(__file__).resolve().parents[2]
_USER_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "OMP_DISPLAY_ENV")


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in _USER_SETTINGS}
    return subprocess.run(args, cwd=REPO, env={**base, "OMP_DISPLAY_ENV": "VERBOSE", **env},
                          capture_output=True, text=True, timeout=300)


def _spin_count(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip().startswith("GOMP_SPINCOUNT")]
    assert lines, stderr[-2000:]
    return lines[0].split("=", 1)[1].strip().strip("'")


def test_recipe_command_makes_openmp_threads_passive_before_torch_loads():
    proc = _run([sys.executable, "recipes/grpo.py", "--help"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _spin_count(proc.stderr) == "0"


@pytest.mark.parametrize(("user", "spin"), [({"OMP_WAIT_POLICY": "ACTIVE"}, "30000000000"),
                                            ({"GOMP_SPINCOUNT": "1000"}, "1000")])
def test_recipe_command_keeps_the_users_wait_setting(user, spin):
    proc = _run([sys.executable, "recipes/grpo.py", "--help"], **user)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _spin_count(proc.stderr) == spin


def test_cli_entry_point_sets_the_default_before_the_command_imports_torch():
    code = ("import os, sys; from verl_trainer.cli import main; main(['--help']); "
            "assert 'torch' not in sys.modules; import torch; print(os.environ['OMP_WAIT_POLICY'])")
    proc = _run([sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "PASSIVE"
    assert _spin_count(proc.stderr) == "0"


def test_env_default_is_set_only_when_unset():
    env: dict[str, str] = {}
    assert apply_thread_env_defaults(env) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    for user in ({"OMP_WAIT_POLICY": "active"}, {"GOMP_SPINCOUNT": "10000"}):
        env = dict(user)
        assert apply_thread_env_defaults(env) == {} and env == user


def test_intra_op_threads_in_a_process_are_its_cpus_over_the_local_ranks():
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs CPU affinity and 2 CPUs")
    two = set(sorted(os.sched_getaffinity(0))[:2])
    one = {min(two)}
    cases = [(one, 1, None, 1), (two, 1, None, 2), (two, 2, None, 1), (two, 4, None, 1), (one, 1, "3", 3)]
    code = ("import os, sys, torch\n"
            "from verl_trainer.utils.threads import set_intra_op_threads\n"
            f"for cpus, local, user, _ in {cases!r}:\n"
            "    os.environ.pop('OMP_NUM_THREADS', None)\n"
            "    if user: os.environ['OMP_NUM_THREADS'] = user\n"
            "    os.sched_setaffinity(0, cpus)\n"
            "    n = set_intra_op_threads(local)\n"
            "    print(n, torch.get_num_threads(), os.environ['OMP_NUM_THREADS'])\n")
    proc = _run([sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [f"{e} {e} {e}" for *_, e in cases]


def test_intra_op_threads_rules():
    assert intra_op_threads(1, {}) == available_cpus()
    assert intra_op_threads(10_000, {}) == 1
    assert intra_op_threads(1, {"OMP_NUM_THREADS": "5"}) == 5
    assert intra_op_threads(1, {"OMP_NUM_THREADS": "x"}) == available_cpus()  # not a count: the default
    with pytest.raises(ValueError, match="local_processes must be >= 1"):
        intra_op_threads(0, {})
