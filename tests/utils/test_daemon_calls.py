"""Calls on daemon threads under a time limit: results and errors come back, a hanging call is abandoned
within its limit, the leak is bounded (refused calls past it) and a process whose call hangs still exits."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from verl_trainer.utils import daemon_calls
from verl_trainer.utils.daemon_calls import AbandonedCallError, DaemonCalls, abandoned_calls


def test_results_and_errors_come_back_and_workers_are_reused():
    calls = DaemonCalls("test")
    assert calls.run(lambda a, b=0: a + b, 1, b=2, timeout_s=5) == 3
    with pytest.raises(KeyError, match="missing"):
        calls.run(lambda: {}["missing"], timeout_s=5)
    out = calls.map([lambda: 1, lambda: 1 / 0, lambda: threading.current_thread().daemon], 5)
    assert out[0] == 1 and isinstance(out[1], ZeroDivisionError) and out[2] is True
    started = calls.started
    for _ in range(20):
        calls.run(int, "7", timeout_s=5)
    assert calls.started == started  # an idle worker serves the next call


def test_a_hanging_call_is_abandoned_at_its_limit_and_the_leak_is_bounded(monkeypatch):
    release = threading.Event()
    calls = DaemonCalls("hang")
    before = abandoned_calls()
    try:
        begin = time.monotonic()
        out = calls.map([lambda: release.wait(60), lambda: "fast"], timeout_s=0.5)
        assert time.monotonic() - begin < 20
        assert isinstance(out[0], AbandonedCallError) and out[0].started and out[1] == "fast"
        assert "ran past its 0.5 s limit" in str(out[0])
        now = abandoned_calls()
        assert now["running"] == before["running"] + 1 and now["abandoned"] == before["abandoned"] + 1
        monkeypatch.setattr(daemon_calls, "MAX_ABANDONED", now["running"])
        with pytest.raises(AbandonedCallError, match="not started: .* still run") as refused:
            calls.run(lambda: "never", timeout_s=5)
        assert not refused.value.started and abandoned_calls()["refused"] == before["refused"] + 1
    finally:
        release.set()
    deadline = time.monotonic() + 20
    while abandoned_calls()["running"] > before["running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert abandoned_calls()["running"] == before["running"]  # the finished call's thread left the count
    assert calls.run(lambda: "again", timeout_s=5) == "again"


def test_a_process_whose_call_hangs_forever_exits_by_itself():
    script = textwrap.dedent("""
        import time
        from verl_trainer.utils.daemon_calls import AbandonedCallError, DaemonCalls
        try:
            DaemonCalls("hang").run(time.sleep, 3600, timeout_s=0.5)
        except AbandonedCallError as exc:
            print("abandoned:", exc)
    """)
    begin = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "abandoned: hang call ran past its 0.5 s limit" in done.stdout
    assert time.monotonic() - begin < 30
