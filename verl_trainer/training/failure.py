"""A crash on one rank ends every rank with that rank's error, never a hang.

All ranks run these parts; :func:`guard` wraps every ``fit`` / ``validate``:

* the failure channel: a client of the rendezvous TCPStore (``MASTER_ADDR:MASTER_PORT``). The first rank
  that fails posts ``(rank, traceback)`` under a key of the current run (first writer wins, ``compare_set``).
* :func:`guard`: on an exception a rank posts its error. If another rank's error is already posted (or, for
  a broken collective, appears within a few seconds), it raises :class:`RankFailedError` carrying that
  rank's traceback, chained to its own exception.
* the watchdog thread: when another rank's error appears it gives the main thread
  :data:`FAILURE_GRACE_S` to end by itself, then ends a main thread still blocked (an NCCL collective)
  with the failing rank's message and exit code 1. A child of the launcher also ends when rank 0 is gone.

A process killed without a Python error (SIGKILL, segfault) cannot post: the launcher's observer posts
``rank r exited with code c`` for it (:mod:`verl_trainer.training.launch`); under torchrun / SLURM the
launcher ends the job; the process group's collective timeout is the last resort. The promise and its
tests: docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

__all__ = ["CollectiveTimeoutError", "RankFailedError", "guard", "start_watchdog"]

FAILURE_GRACE_S = 10.0  # gloo collectives fail quickly once the failing process exits; NCCL ones may not
"""Seconds a rank's main thread gets to end by itself once another rank's failure is known."""
POLL_S = 0.25
COMM_ERROR_WAIT_S = 5.0
ACK_WAIT_S = 3.0
LAUNCHER_PID_ENV = "VERL_TRAINER_LAUNCHER_PID"
_COMM_ERROR_MARKERS = ("Connection closed", "Connection reset", "Broken pipe", "gloo", "NCCL", "timed out")


class RankFailedError(RuntimeError):
    """Another rank failed first.

    Its traceback is printed once, by that rank; this error's message is one line: the rank and the last
    line of its error.

    Attributes:
        rank: The rank that failed first.
        traceback: Its traceback, as text.
    """

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"rank {rank} failed, so this rank stops too (rank {rank} printed the traceback): "
                         f"{last_line(message)}")
        self.rank = rank
        self.traceback = message

    def __reduce__(self) -> tuple[type, tuple[int, str]]:
        """Pickled with its own arguments (Ray and multiprocessing send errors between processes)."""
        return type(self), (self.rank, self.traceback)


class CollectiveTimeoutError(RuntimeError):
    """A collective waited longer than the collective timeout for the other ranks."""


def last_line(message: str) -> str:
    """The last non-empty line of a traceback (the exception and its message)."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else message


@dataclass(frozen=True)
class Failure:
    """A posted failure: the rank and its message (a traceback)."""

    rank: int
    message: str


class _Channel:
    """The failure keys of the current run in the rendezvous store; thread-safe."""

    def __init__(self, store: dist.Store) -> None:
        self._store = store
        self._lock = threading.Lock()
        self.generation = 0
        self.broken = False

    def _key(self, name: str) -> str:
        return f"verl_trainer/failure/{self.generation}/{name}"

    def post(self, failure: Failure) -> Failure:
        """Post ``failure`` unless one is posted already; returns the one that is posted."""
        value = f"{failure.rank}\n{failure.message}"
        with self._lock:
            stored = self._store.compare_set(self._key("error"), "", value)
        return _decode(stored)

    def read(self) -> Failure | None:
        """The posted failure of the current run, if any."""
        with self._lock:
            key = self._key("error")
            if not self._store.check([key]):
                return None
            return _decode(self._store.get(key))

    def ack(self) -> None:
        """Count this rank as having seen the failure."""
        with self._lock:
            self._store.add(self._key("acks"), 1)

    def acks(self) -> int:
        """How many ranks acknowledged the failure."""
        with self._lock:
            return int(self._store.add(self._key("acks"), 0))


def _decode(raw: bytes) -> Failure:
    rank, _, message = raw.decode(errors="replace").partition("\n")
    return Failure(int(rank), message)


class _State:
    def __init__(self) -> None:
        self.rank = 0
        self.world_size = 1
        self.channel: _Channel | None = None
        self.seen: Failure | None = None
        self.seen_at: float | None = None
        self.active = False  # a guarded run is in progress and has not handled its failure yet
        self.failed = False  # a guarded run of this process ended with an exception
        self.thread: threading.Thread | None = None
        self.collective_timeout: timedelta | None = None


_STATE = _State()


def _connect_store() -> dist.Store | None:
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    try:
        return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=30))
    except Exception:  # no store to talk to: the collective timeout remains the safety net
        return None


def start_watchdog(rank: int, world_size: int, collective_timeout: timedelta | None = None) -> None:
    """Connect the failure channel and start the watchdog thread (once per process)."""
    _STATE.rank, _STATE.world_size = rank, world_size
    _STATE.collective_timeout = collective_timeout
    if _STATE.thread is not None:
        return
    store = _connect_store()
    _STATE.channel = _Channel(store) if store is not None else None
    _STATE.thread = threading.Thread(target=_watch, name="verl-trainer-watchdog", daemon=True)
    _STATE.thread.start()


def _watch() -> None:
    launcher_pid = int(os.environ.get(LAUNCHER_PID_ENV, "0"))
    is_child = launcher_pid not in (0, os.getpid())
    main = threading.main_thread()
    while main.is_alive():
        time.sleep(POLL_S)
        if is_child and os.getppid() != launcher_pid:
            hard_exit(current_message() or "the launching process (rank 0) is gone")
        channel = _STATE.channel
        if _STATE.active and _STATE.seen is None and channel is not None and not channel.broken:
            try:
                found = channel.read()
                if found is not None and found.rank != _STATE.rank:
                    _STATE.seen, _STATE.seen_at = found, time.monotonic()
                    channel.ack()
            except Exception:  # the store host is gone (e.g. the run ended); stop asking it
                channel.broken = True
        seen_at = _STATE.seen_at
        if _STATE.active and seen_at is not None and time.monotonic() - seen_at > FAILURE_GRACE_S:
            hard_exit(_format(_STATE.seen))


def _format(failure: Failure | None) -> str:
    if failure is None:
        return "another rank failed"
    return f"rank {failure.rank} failed: {last_line(failure.message)}"


def current_message() -> str | None:
    """The failure of the current run as text, if one is known."""
    failure = _STATE.seen
    if failure is None and _STATE.channel is not None and not _STATE.channel.broken:
        try:
            failure = _STATE.channel.read()
        except Exception:
            failure = None
    return None if failure is None else _format(failure)


def hard_exit(message: str) -> None:
    """Print ``message`` for this rank and end the process with exit code 1 at once."""
    sys.stderr.write(f"[verl_trainer rank {_STATE.rank}] ending this process: {message}\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)


def run_failed() -> bool:
    """Whether a guarded run of this process ended with an exception."""
    return _STATE.failed


def report_dead_rank(rank: int, returncode: int) -> None:
    """Post that ``rank`` died without posting its own error (called by the launcher's observer)."""
    how = f"was killed by signal {-returncode}" if returncode < 0 else f"exited with code {returncode}"
    message = f"rank {rank} {how} without a Python error (see its output above)"
    channel = _STATE.channel
    if channel is not None and not channel.broken:
        try:
            channel.post(Failure(rank, message))
            return
        except Exception:
            channel.broken = True
    _STATE.seen = _STATE.seen or Failure(rank, message)


def _looks_like_comm_error(exc: BaseException) -> bool:
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _COMM_ERROR_MARKERS)


def _on_exception(exc: BaseException) -> Failure:
    """Post this rank's error (or find the earlier one) and return the failure every rank reports."""
    own = Failure(_STATE.rank, "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    if _STATE.seen is not None:
        return _STATE.seen
    channel = _STATE.channel
    if channel is None or channel.broken or _STATE.world_size == 1:
        return own
    try:
        if _looks_like_comm_error(exc):  # likely a consequence: give the origin time to post
            deadline = time.monotonic() + COMM_ERROR_WAIT_S
            while time.monotonic() < deadline:
                found = _STATE.seen or channel.read()
                if found is not None:
                    return found
                time.sleep(POLL_S)
        posted = channel.post(own)
        if posted.rank != own.rank:
            channel.ack()  # the origin stops waiting for us sooner
        if posted.rank == own.rank:  # we are the origin: let the others read it before we exit
            deadline = time.monotonic() + ACK_WAIT_S
            while channel.acks() < _STATE.world_size - 1 and time.monotonic() < deadline:
                time.sleep(POLL_S)
            return own
        return posted
    except Exception:  # the store is gone: report our own error
        return own


@contextlib.contextmanager
def guard() -> Iterator[None]:
    """Run one ``fit`` / ``validate`` so that a failure on any rank ends every rank with its error.

    Collective in spirit: every rank enters it the same number of times (each entry starts a new run
    generation, so a failure handled in an earlier run is not seen again).

    Raises:
        RankFailedError: When another rank failed first (chained to this rank's own exception).
    """
    if _STATE.channel is not None:
        _STATE.channel.generation += 1
    _STATE.seen = _STATE.seen_at = None
    _STATE.active = True
    try:
        yield
    except BaseException as exc:
        failure = _on_exception(exc)
        _STATE.active = False
        _STATE.failed = True
        if failure.rank != _STATE.rank:
            error = RankFailedError(failure.rank, failure.message)
            own = "".join(traceback.format_exception_only(type(exc), exc))
            if _looks_like_comm_error(exc) or last_line(own) == last_line(failure.message):
                raise error from None  # a consequence, or the same error: printed once, by its rank
            raise error from exc
        if _STATE.collective_timeout is not None and _looks_like_comm_error(exc) and "imed out" in str(exc):
            seconds = _STATE.collective_timeout.total_seconds()
            raise CollectiveTimeoutError(
                f"a collective waited longer than collective_timeout={seconds:g} s for the other ranks: one "
                "of them is stalled or much slower (see its output); if such waits are expected, raise "
                "trainer.collective_timeout (Trainer(collective_timeout=...))"
            ) from exc
        raise
    finally:
        _STATE.active = False
