"""A small pool of worker processes whose every call has a time limit; a call past it kills its worker.

``concurrent.futures`` cannot stop a running call, so a pathological input (a huge sympy expression, a
regex that backtracks forever) would stall the caller for good. Here each worker runs one call at a time;
when a call passes ``timeout_s`` its worker is killed and replaced, and the call's result is a
:class:`CallTimeoutError`. A worker is a fresh interpreter (``python -m verl_trainer.utils.timeout_pool``:
no threads or state inherited from a training process, and the caller's ``__main__`` is not re-run) that
imports ``preload`` once at start.

Calls and results travel pickled through pipes between these processes only (nothing is read from a file);
``fn`` must be importable by name (a module-level function).
"""

from __future__ import annotations

import atexit
import importlib
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

__all__ = ["CallFailedError", "CallTimeoutError", "TimeoutPool"]

_R = TypeVar("_R")


class CallTimeoutError(TimeoutError):
    """A call ran past the pool's ``timeout_s`` (its worker was killed)."""


class CallFailedError(RuntimeError):
    """A call raised in its worker (or its worker died); the message holds the worker's traceback."""


STARTUP_TIMEOUT_S = 300.0
"""How long a new worker may take to import ``preload`` (a loaded machine, a cold disk)."""


def _worker_loop(inbox: Connection, outbox: Connection, preload: Sequence[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the parent, which ends the workers
    try:
        for module in preload:
            importlib.import_module(module)
    except BaseException as exc:  # noqa: BLE001
        outbox.send((False, f"{type(exc).__name__}: {exc}"))
        return
    outbox.send((True, "ready"))
    while True:
        try:
            fn, args = inbox.recv()
        except (EOFError, OSError):
            return
        try:
            reply = (True, fn(*args))
        except BaseException as exc:  # noqa: BLE001  (reported to the caller, the worker goes on)
            reply = (False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        try:
            outbox.send(reply)
        except Exception as exc:  # noqa: BLE001  (an unpicklable result)
            outbox.send((False, f"the result could not be sent back: {type(exc).__name__}: {exc}"))


@dataclass
class _Worker:
    process: subprocess.Popen
    inbox: Connection
    conn: Connection


class TimeoutPool:
    """Run calls in worker processes, each under a time limit.

    Args:
        num_workers: Worker processes (started on first use).
        timeout_s: The longest one call may run.
        preload: Modules each worker imports once when it starts (e.g. the module of ``fn``).
    """

    def __init__(self, num_workers: int = 2, timeout_s: float = 10.0, preload: Sequence[str] = ()) -> None:
        self.check_settings(num_workers, timeout_s)
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.preload = list(preload)
        self._workers: list[_Worker] = []
        self._starting: list[_Worker] = []  # replacements started after a timeout, not yet waited for
        self.timeouts = 0
        """Calls that ran past ``timeout_s`` so far."""
        self._lock = threading.Lock()  # one map at a time: a caller abandoned on a daemon thread may be in it
        atexit.register(self.close)

    @staticmethod
    def check_settings(num_workers: int, timeout_s: float) -> None:
        """Raise ``ValueError`` unless ``num_workers >= 1`` and ``timeout_s > 0``."""
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be >= 1")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")

    def _start(self) -> _Worker:
        worker = self._starting.pop(0) if self._starting else self._spawn()
        self._workers.append(self._ready([worker])[0])
        return worker

    def _replace(self, worker: _Worker, needed_now: bool) -> _Worker | None:
        """Kill ``worker``; start another: waited for when calls are waiting, else in the background."""
        self._kill(worker)
        if needed_now:
            return self._start()
        self._starting.append(self._spawn())
        return None

    def _ready(self, workers: list[_Worker]) -> list[_Worker]:
        """Wait until each worker has imported ``preload`` (its time does not count against a call)."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for worker in workers:
            if not worker.conn.poll(max(0.0, deadline - time.monotonic())):
                worker.process.kill()
                raise RuntimeError(f"a worker process did not start within {STARTUP_TIMEOUT_S:g} s "
                                   f"(importing {self.preload})")
            try:
                ok, message = worker.conn.recv()
            except (EOFError, OSError):
                ok, message = False, f"it exited with code {worker.process.wait()}"
            if not ok:
                raise RuntimeError(f"a worker process failed to import {self.preload}: {message}")
        return workers

    def _spawn(self) -> _Worker:
        to_child, from_parent = os.pipe()[::-1]  # (write end, read end)
        from_child, to_parent = os.pipe()
        process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(from_parent), str(to_parent), *self.preload],
            pass_fds=(from_parent, to_parent), stdin=subprocess.DEVNULL,
        )
        os.close(from_parent)
        os.close(to_parent)
        return _Worker(process, Connection(to_child, readable=False), Connection(from_child, writable=False))

    def _kill(self, worker: _Worker) -> None:
        worker.process.kill()
        worker.process.wait(timeout=10)
        worker.inbox.close()
        worker.conn.close()
        for group in (self._workers, self._starting):
            if worker in group:
                group.remove(worker)

    def close(self) -> None:
        """Stop every worker (a later call starts new ones)."""
        for worker in [*self._workers, *self._starting]:
            self._kill(worker)

    def map(self, fn: Callable[..., _R], calls: Sequence[tuple[Any, ...]]
            ) -> list[_R | CallTimeoutError | CallFailedError]:
        """``[fn(*args) for args in calls]``, in parallel; a failed call's entry is the exception.

        Thread-safe: concurrent maps run one after the other (each waits at most its calls' limits).

        Returns:
            One entry per call, in order: the result, a :class:`CallTimeoutError` or a
            :class:`CallFailedError`.
        """
        with self._lock:
            return self._map(fn, calls)

    def _map(self, fn: Callable[..., _R], calls: Sequence[tuple[Any, ...]]
             ) -> list[_R | CallTimeoutError | CallFailedError]:
        results: list[Any] = [None] * len(calls)
        pending = deque(enumerate(calls))
        missing = min(self.num_workers, len(calls)) - len(self._workers) - len(self._starting)
        self._starting += [self._spawn() for _ in range(max(missing, 0))]  # started together
        while len(self._workers) < min(self.num_workers, len(calls)):
            self._start()
        idle = list(self._workers)
        busy: dict[Connection, tuple[_Worker, int, float]] = {}
        while pending or busy:
            if pending and not idle and not busy:
                idle.append(self._start())
            while pending and idle:
                worker = idle.pop()
                index, args = pending.popleft()
                worker.inbox.send((fn, tuple(args)))
                busy[worker.conn] = (worker, index, time.monotonic())
            deadline = min(started for _, _, started in busy.values()) + self.timeout_s
            for conn in wait(list(busy), timeout=max(0.0, deadline - time.monotonic())):
                worker, index, _ = busy.pop(conn)  # type: ignore[index]
                try:
                    ok, value = conn.recv()  # type: ignore[union-attr]
                except (EOFError, OSError):
                    results[index] = CallFailedError(f"the worker running {fn.__name__}{calls[index]!r} died")
                    worker = self._replace(worker, needed_now=bool(pending))
                else:
                    results[index] = value if ok else CallFailedError(value)
                if worker is not None:
                    idle.append(worker)
            now = time.monotonic()
            for conn, (worker, index, started) in list(busy.items()):
                if now - started >= self.timeout_s:
                    del busy[conn]
                    self.timeouts += 1
                    limit = f"{self.timeout_s:g} s"
                    results[index] = CallTimeoutError(f"{fn.__name__} ran past its {limit} limit")
                    replacement = self._replace(worker, needed_now=bool(pending) and not idle)
                    if replacement is not None:
                        idle.append(replacement)
        return results

    def run(self, fn: Callable[..., _R], *args: Any) -> _R:
        """``fn(*args)`` in a worker.

        Raises:
            CallTimeoutError: It ran past ``timeout_s``.
            CallFailedError: It raised (the message holds the worker's traceback).
        """
        result = self.map(fn, [args])[0]
        if isinstance(result, (CallTimeoutError, CallFailedError)):
            raise result
        return result


if __name__ == "__main__":  # a worker: python -m verl_trainer.utils.timeout_pool IN_FD OUT_FD [MODULE ...]
    _worker_loop(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False),
                 sys.argv[3:])
