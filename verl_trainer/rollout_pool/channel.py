"""Messages between trainer ranks and rollout ranks, in the run's key-value store (c10d ``TCPStore``).

A message is a pickled object under a key written once and deleted by its reader; keys are sequenced
(``job/<trainer rank>/<n>``, ``result/<trainer rank>/<n>``, ``sync/<n>``), so no message is read twice and
none depends on timing. Sample groups are small (token ids and log-probs), so the store carries them; the
weights go over a process group (:mod:`.buckets`).

Liveness: each rollout rank runs a :class:`Heartbeat` (a counter bumped every ``HEARTBEAT_S``); a reader
waiting on a rollout rank checks it with :class:`Liveness` and raises :class:`RolloutPoolError` naming
the rank whose counter stood still for ``timeout_s`` (no hang, no clock shared between hosts needed).
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["HEARTBEAT_S", "Heartbeat", "Liveness", "PoolStoppedError", "RolloutPoolError", "post", "take"]

HEARTBEAT_S = 0.2
_POLL_S = (0.002, 0.05)


class RolloutPoolError(RuntimeError):
    """A rollout rank stopped answering (killed, hung) or failed; the message names its global rank."""


class PoolStoppedError(Exception):
    """The pool was closed while waiting for a message."""


def post(store: Any, key: str, obj: Any) -> None:
    """Write ``obj`` under ``key`` (pickled)."""
    store.set(key, pickle.dumps(obj))


def take(store: Any, key: str, stopped: Callable[[], bool] = lambda: False,
         check: Callable[[], None] | None = None) -> Any:
    """Wait for ``key``, read it, delete it.

    Args:
        store: The pool's store.
        key: The message's key.
        stopped: Polled while waiting; ``True`` raises :class:`PoolStoppedError`.
        check: Polled while waiting (every ``HEARTBEAT_S``); raises to give up (e.g. :meth:`Liveness.check`).
    """
    delay, last_check = _POLL_S[0], time.monotonic()
    while not store.check([key]):
        if stopped():
            raise PoolStoppedError(key)
        if check is not None and time.monotonic() - last_check > HEARTBEAT_S:
            check()
            last_check = time.monotonic()
        time.sleep(delay)
        delay = min(delay * 2, _POLL_S[1])
    obj = pickle.loads(store.get(key))
    store.delete_key(key)
    return obj


class Heartbeat:
    """Bumps ``alive/<rank>`` every :data:`HEARTBEAT_S` on a daemon thread until :meth:`stop`."""

    def __init__(self, store: Any, rank: int) -> None:
        self.store, self.rank = store, rank
        self._stop = threading.Event()
        self.store.set(f"alive/{rank}", "0")
        self._thread = threading.Thread(target=self._run, name=f"rollout-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        beat = 0
        while not self._stop.wait(HEARTBEAT_S):
            beat += 1
            try:
                self.store.set(f"alive/{self.rank}", str(beat))
            except Exception:  # the store's host (trainer rank 0) is gone: nothing left to tell
                return

    def stop(self) -> None:
        """End the thread (the counter then stands still)."""
        self._stop.set()


class Liveness:
    """Tells which rollout ranks' heartbeats stood still for ``timeout_s``.

    Args:
        store: The pool's store.
        ranks: The global ranks watched.
        timeout_s: Seconds without a beat after which a rank counts as gone.
        what: Named in the error (the setting that bounds it).
    """

    def __init__(self, store: Any, ranks: Sequence[int], timeout_s: float,
                 what: str = "weight_sync_timeout_s") -> None:
        self.store, self.ranks, self.timeout_s, self.what = store, list(ranks), timeout_s, what
        now = time.monotonic()
        self._seen: dict[int, tuple[str | None, float]] = {r: (None, now) for r in self.ranks}

    def silent(self, ranks: Sequence[int] | None = None) -> list[int]:
        """The ranks among ``ranks`` (default: all) whose counter did not move for ``timeout_s``."""
        now, gone = time.monotonic(), []
        for rank in self.ranks if ranks is None else ranks:
            key = f"alive/{rank}"
            value = self.store.get(key).decode() if self.store.check([key]) else None
            last, since = self._seen[rank]
            if value != last:
                self._seen[rank] = (value, now)
            elif now - since > self.timeout_s:
                gone.append(rank)
        return gone

    def check(self, ranks: Sequence[int] | None = None, doing: str = "") -> None:
        """Raise :class:`RolloutPoolError` naming the silent ranks among ``ranks``."""
        gone = self.silent(ranks)
        if gone:
            raise RolloutPoolError(
                f"rollout rank(s) {gone} (global rank) did not answer for {self.what}={self.timeout_s} s"
                f"{' while ' + doing if doing else ''}: the process was killed or hangs; see its log, or "
                f"raise algorithm.rollout.{self.what} if it is only slow")

    def wait_silent(self, ranks: Sequence[int] | None = None) -> list[int]:
        """After a failed broadcast: poll up to ``timeout_s`` for the ranks that went silent."""
        deadline = time.monotonic() + self.timeout_s + 2 * HEARTBEAT_S
        while time.monotonic() < deadline:
            gone = self.silent(ranks)
            if gone:
                return gone
            time.sleep(HEARTBEAT_S)
        return []
