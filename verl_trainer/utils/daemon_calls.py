"""User callables under a time limit on reusable daemon threads; a call past its limit is abandoned.

Contract of :class:`DaemonCalls`:

* each call runs on a **daemon** thread (reused between calls): the caller waits at most ``timeout_s``;
* a call past it is **abandoned**: the caller gets :class:`AbandonedCallError` (a ``TimeoutError``) and
  goes on; the thread finishes the call whenever it does and then exits, and never keeps the process
  alive at exit;
* the leak is **bounded**: while :data:`MAX_ABANDONED` abandoned calls still run in this process, a new
  call is refused at once with an :class:`AbandonedCallError` (``started=False``), handled like a
  time-out. :func:`abandoned_calls` reports the counts;
* the caller's current CUDA device and grad mode are set on the worker thread for each call.

Limits: a call that holds the GIL in C code stalls every thread of the process (such work belongs in a
process: :class:`~verl_trainer.utils.timeout_pool.TimeoutPool`); code that installs signal handlers
(``signal.alarm`` time-outs) cannot run off the main thread and raises ``ValueError``.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["MAX_ABANDONED", "AbandonedCallError", "DaemonCalls", "abandoned_calls"]

_R = TypeVar("_R")

logger = logging.getLogger(__name__)

# Reward functions, tools and environments are arbitrary Python objects (closures, stateful tools, TRL's
# log_metric callback) that cannot be sent to another process, and the training process holds
# accelerator and collective state that a forked child must not copy: so they run on threads, which
# cannot be killed, and a call past its limit is abandoned rather than stopped. Daemon threads (not
# concurrent.futures workers, which are joined at exit) let the process end whatever such a call does.
MAX_ABANDONED = 64
"""Abandoned calls that may still run at once in the process; past it new calls are refused."""
MAX_IDLE = 32
"""Idle worker threads a :class:`DaemonCalls` keeps for reuse (more exit when their call ends)."""


class AbandonedCallError(TimeoutError):
    """A call past its time limit, left running on its daemon thread (``started=True``), or not started.

    ``started=False``: refused because :data:`MAX_ABANDONED` abandoned calls still run.
    """

    def __init__(self, message: str, started: bool = True) -> None:
        super().__init__(message)
        self.started = started


_LOCK = threading.Lock()
_ABANDONED: set[threading.Thread] = set()
_COUNTS = {"abandoned": 0, "refused": 0}


def abandoned_calls() -> dict[str, int]:
    """Counts of ``running`` (abandoned calls still running), ``abandoned`` and ``refused`` calls.

    ``abandoned`` and ``refused`` count since the process started.
    """
    with _LOCK:
        return {"running": len(_ABANDONED), **_COUNTS}


@dataclass
class _Job:
    fn: Callable[[], Any]
    state: tuple[Any, ...]
    done: Any  # a held lock, released when the call has finished
    finished: bool = False
    value: Any = None
    error: BaseException | None = None


def _caller_state() -> tuple[Any, ...]:
    """The calling thread's torch state that is per-thread: ``(cuda device or None, grad enabled)``."""
    torch = sys.modules.get("torch")
    if torch is None:
        return (None, True)
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    return (device, torch.is_grad_enabled())


def _run(job: _Job) -> None:
    torch = sys.modules.get("torch")
    device, grad = job.state
    try:
        if torch is not None:
            if device is not None:
                torch.cuda.set_device(device)
            torch.set_grad_enabled(grad)
        job.value = job.fn()
    except BaseException as exc:  # noqa: BLE001  (handed to the caller, the worker goes on)
        job.error = exc


class _Worker(threading.Thread):
    def __init__(self, owner: DaemonCalls) -> None:
        super().__init__(name=f"{owner.name}-{owner.started}", daemon=True)
        self.owner = owner
        self.inbox: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self.abandoned = False

    def run(self) -> None:
        try:
            while True:
                job = self.inbox.get()
                _run(job)
                with _LOCK:
                    job.finished = True
                    job.done.release()
                    if self.abandoned or len(self.owner.idle) >= MAX_IDLE:
                        return
                    self.owner.idle.append(self)
        finally:
            with _LOCK:
                _ABANDONED.discard(self)


class DaemonCalls:
    """Runs calls on reusable daemon threads, each under a time limit (see the module docstring).

    Thread-safe: several callers may use one instance at once.

    Args:
        name: Thread-name prefix and the name messages use (e.g. ``"reward"``, ``"agent-tool"``).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.idle: list[_Worker] = []
        self.started = 0
        """Worker threads started so far."""

    def _worker(self) -> _Worker | None:
        """An idle worker, a new one, or ``None`` when :data:`MAX_ABANDONED` abandoned calls still run."""
        with _LOCK:
            if len(_ABANDONED) >= MAX_ABANDONED:
                _COUNTS["refused"] += 1
                return None
            if self.idle:
                return self.idle.pop()
            self.started += 1
        worker = _Worker(self)
        worker.start()
        return worker

    def map(self, calls: Sequence[Callable[[], _R]], timeout_s: float) -> list[_R | BaseException]:
        """Run every zero-argument call concurrently; together they may take ``timeout_s`` seconds.

        Returns:
            One entry per call, in order: its return value, the exception it raised, or an
            :class:`AbandonedCallError` (past the limit, or refused while too many abandoned calls run).
        """
        return [value if error is None else error for value, error in self.outcomes(calls, timeout_s)]

    def outcomes(self, calls: Sequence[Callable[[], Any]], timeout_s: float
                  ) -> list[tuple[Any, BaseException | None]]:
        """``(value, None)`` or ``(None, exception)`` per call, in order (see :meth:`map`)."""
        state = _caller_state()
        jobs: list[tuple[_Job, _Worker | None]] = []
        for fn in calls:
            done = threading.Lock()
            done.acquire()
            job = _Job(fn, state, done)
            worker = self._worker()
            if worker is not None:
                worker.inbox.put(job)
            jobs.append((job, worker))
        deadline = time.monotonic() + timeout_s
        results: list[tuple[Any, BaseException | None]] = []
        for job, worker in jobs:
            if worker is None:
                running = abandoned_calls()["running"]
                logger.warning("%s: a call was not started: %d abandoned calls still run (the most is %d)",
                               self.name, running, MAX_ABANDONED)
                results.append((None, AbandonedCallError(
                    f"{self.name} call not started: {running} earlier calls that ran past their time limit "
                    f"still run (at most {MAX_ABANDONED} may); the function hangs — fix it", started=False)))
                continue
            job.done.acquire(timeout=max(0.0, deadline - time.monotonic()))
            with _LOCK:
                finished = job.finished
                if not finished:
                    worker.abandoned = True
                    _ABANDONED.add(worker)
                    _COUNTS["abandoned"] += 1
            if not finished:
                message = f"{self.name} call ran past its {timeout_s:g} s limit and was abandoned"
                results.append((None, AbandonedCallError(message)))
            else:
                results.append((job.value, job.error))
        return results

    def run(self, fn: Callable[..., _R], *args: Any, timeout_s: float, **kwargs: Any) -> _R:
        """``fn(*args, **kwargs)`` on a worker thread, waited for at most ``timeout_s`` seconds.

        Raises:
            AbandonedCallError: It ran past ``timeout_s`` (left running), or was refused.
            BaseException: Whatever ``fn`` raised.
        """
        value, error = self.outcomes([lambda: fn(*args, **kwargs)], timeout_s)[0]
        if error is not None:
            raise error
        return value
