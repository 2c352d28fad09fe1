"""Messages between trainer ranks and rollout ranks, in the run's key-value store (c10d ``TCPStore``).

A message is plain data under a key written once and deleted by its reader: a safetensors blob whose tensors
are the message's tensors and whose metadata is the rest as JSON (:func:`encode` / :func:`decode`; nothing is
unpickled, so a peer that can reach the store cannot make a reader run code); keys are sequenced
(``job/<trainer rank>/<n>``, ``result/<trainer rank>/<n>``, ``sync/<n>``), so no message is read twice and
none depends on timing. Sample groups are small (token ids and log-probs), so the store carries them; the
weights go over a process group (:mod:`.buckets`).

Liveness: each rollout rank runs a :class:`Heartbeat` (a counter bumped every ``HEARTBEAT_S``); a reader
waiting on a rollout rank checks it with :class:`Liveness` and raises :class:`RolloutPoolError` naming
the rank whose counter stood still for ``timeout_s`` (no hang, no clock shared between hosts needed).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from tensordict import TensorDict

from verl_trainer.data.batch_state import batch_from_state, batch_state

__all__ = ["HEARTBEAT_S", "Heartbeat", "Liveness", "PoolStoppedError", "RolloutPoolError", "decode", "encode",
           "post", "take"]

HEARTBEAT_S = 0.2
_POLL_S = (0.002, 0.05)


class RolloutPoolError(RuntimeError):
    """A rollout rank stopped answering (killed, hung) or failed; the message names its global rank."""


class PoolStoppedError(Exception):
    """The pool was closed while waiting for a message."""


def encode(obj: Any) -> bytes:
    """``obj`` as bytes, with the tensors and flat ``TensorDict`` batches nested in it.

    ``obj`` is JSON data (None, bool, int, float, str, lists, tuples, str-keyed dicts) holding tensors and
    batches whose non-tensor entries are per-sample JSON data.

    Raises:
        TypeError: a value of another type (named); ValueError: a batch entry JSON cannot encode.
    """
    tensors: dict[str, torch.Tensor] = {}

    def plain(value: Any) -> Any:
        if isinstance(value, TensorDict):
            state = batch_state(value)
            ref = f"b{len(tensors)}"
            for name, tensor in state["tensors"].items():
                tensors[f"{ref}/{name}"] = tensor.contiguous().clone()
            return {"batch": ref, "size": state["size"], "keys": list(state["tensors"]),
                    "objects": state["objects"]}
        if isinstance(value, torch.Tensor):
            ref = f"t{len(tensors)}"
            tensors[ref] = value.detach().to("cpu").contiguous().clone()
            return {"tensor": ref}
        if isinstance(value, dict):
            if not all(isinstance(k, str) for k in value):
                raise TypeError(f"a rollout-pool message's dict keys must be str, got {list(value)!r}")
            return {"dict": {k: plain(v) for k, v in value.items()}}
        if isinstance(value, (list, tuple)):
            return {"list": [plain(v) for v in value]}
        if value is None or isinstance(value, (bool, int, float, str)):
            return {"value": value}
        raise TypeError(f"a rollout-pool message cannot carry a {type(value).__name__} (JSON data, tensors "
                        "and flat TensorDict batches only)")

    meta = json.dumps(plain(obj))
    return save_tensors(tensors, metadata={"message": meta})


def decode(blob: bytes) -> Any:
    """The object :func:`encode` wrote (tuples come back as lists; batches with ``NonTensorStack``s)."""
    tensors = load_tensors(blob)
    header_len = int.from_bytes(blob[:8], "little")
    meta = json.loads(json.loads(blob[8:8 + header_len])["__metadata__"]["message"])

    def value_of(node: dict[str, Any]) -> Any:
        if "batch" in node:
            ref = node["batch"]
            return batch_from_state({"size": node["size"], "objects": node["objects"],
                                     "tensors": {k: tensors[f"{ref}/{k}"] for k in node["keys"]}})
        if "tensor" in node:
            return tensors[node["tensor"]]
        if "dict" in node:
            return {k: value_of(v) for k, v in node["dict"].items()}
        if "list" in node:
            return [value_of(v) for v in node["list"]]
        return node["value"]

    return value_of(meta)


def post(store: Any, key: str, obj: Any) -> None:
    """Write ``obj`` under ``key`` (:func:`encode`)."""
    store.set(key, encode(obj))


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
    obj = decode(store.get(key))
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
