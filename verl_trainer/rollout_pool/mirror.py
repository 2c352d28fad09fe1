"""Calls every process of the launched world must make, which the rollout ranks make on a trainer's word.

A launcher may need every one of its workers to take part in a call the trainer ranks make: Ray Train's
``ray.train.report`` is a barrier over all workers, so with ``placement="separate"`` a checkpoint report
blocks until the rollout workers report too. Trainer rank 0 posts such a call as ``mirror/<n>`` (a kind
and a plain-data payload: a ``dict`` of numbers and strings) *before* it makes its own;
on each rollout rank a :class:`Mirrors` thread takes ``mirror/0, 1, ...`` in order and runs the handler of
the kind (the callbacks' :meth:`~verl_trainer.callbacks.Callback.rollout_rank_mirrors`), beside the
generation. A kind without a handler, or a handler that raises, is recorded and raised when serving ends;
later messages are still taken (a barrier on the trainer side would otherwise wait for ever).
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from verl_trainer.rollout_pool.channel import PoolStoppedError, post, take

__all__ = ["Mirrors", "post_mirror"]

Handler = Callable[[dict[str, Any]], None]


def post_mirror(pool: Any, kind: str, payload: dict[str, Any]) -> None:
    """Trainer rank 0: ask every rollout rank to run its ``kind`` handler with ``payload`` (others: no-op).

    Each rollout rank takes every message (the store key stays until the last one took it: one key per
    rollout rank).
    """
    if pool is None or pool.rank != 0:
        return
    seq = pool.mirrors_posted
    pool.mirrors_posted += 1
    for rank in pool.rollout_ranks:
        post(pool.store, f"mirror/{rank}/{seq}", {"kind": kind, "payload": payload})


class Mirrors:
    """A rollout rank's thread running the mirrored calls (see the module docstring).

    Args:
        pool: This rollout rank's :class:`~verl_trainer.rollout_pool.world.Pool`.
        handlers: Kind -> handler.
    """

    def __init__(self, pool: Any, handlers: Mapping[str, Handler]) -> None:
        self.pool, self.handlers = pool, dict(handlers)
        self.errors: list[str] = []
        self.done = 0
        self._thread = threading.Thread(target=self._run, name="rollout-pool-mirrors", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                message = take(self.pool.store, f"mirror/{self.pool.rank}/{self.done}", self.pool.stopped)
                handler = self.handlers.get(message["kind"])
                if handler is None:
                    self.errors.append(f"rollout rank {self.pool.rank}: no handler for the mirrored call "
                                       f"{message['kind']!r} (known: {sorted(self.handlers)})")
                else:
                    try:
                        handler(message["payload"])
                    except Exception:  # noqa: BLE001 - raised when serving ends
                        self.errors.append(f"rollout rank {self.pool.rank}: mirrored call "
                                           f"{message['kind']!r} failed:\n{traceback.format_exc()}")
                self.done += 1
        except PoolStoppedError:
            return

    def finish(self, timeout_s: float) -> None:
        """Wait for the thread (the pool is stopped); raise what a mirrored call recorded.

        Raises:
            RuntimeError: A kind had no handler or a handler raised (every such call's text).
        """
        self._thread.join(timeout=timeout_s)
        if self.errors:
            raise RuntimeError("\n".join(self.errors))
