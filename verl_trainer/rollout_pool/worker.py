"""A rollout rank's loop (``placement="separate"``): receive weight versions, generate the groups sent.

The rollout is built here from ``algorithm.rollout`` (``name``: ``hf`` or ``vllm``; one engine per rollout
rank, built on the main thread, which makes every call into it). Two threads: the receiver takes
``sync/<n>`` (the version and, with ``lora_sync=adapter``, the adapters' config) and joins that version's
broadcast (:func:`~.buckets.receive_weights`) into a snapshot kept by version; the main thread takes the
jobs of the trainer ranks it serves in a fixed order (``job/<r>/<n>`` for ``n = 0, 1, ...`` and each served
``r``), loads the job's version into the rollout when it is not loaded — merged weights through
``rollout.update_weights``, adapters as the rollout's LoRA version ``n`` (``rollout.load_adapter``) —
(versions older than it are freed: jobs arrive in non-decreasing version order), generates with
:meth:`~verl_trainer.algorithms.stages.rollout.RolloutStage.sample` (the colocated rollout's code: uids,
per-response seeds) — or, for a validation job, with ``BaseRollout.generate`` on the validation seed
stream and the job's sampling overrides — and posts the batch, or the error's text, as
``result/<r>/<n>``. Both stop when trainer rank 0 posts ``stop``. At most ``max_staleness + 2`` snapshots
are alive (``k + 1`` once a group starts, one more between a version's arrival and the next group's
start).
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from verl_trainer.algorithms.stages.rollout import RolloutStage
from verl_trainer.rollout import build_rollout
from verl_trainer.rollout_pool.buckets import receive_weights
from verl_trainer.rollout_pool.channel import Heartbeat, PoolStoppedError, post, take
from verl_trainer.rollout_pool.mirror import Handler, Mirrors

__all__ = ["serve"]


class _Snapshot(NamedTuple):
    tensors: dict[str, torch.Tensor]
    adapter_config: dict[str, Any] | None
    """``None``: the model's (merged) tensors; else the adapters' ``adapter_config.json`` content."""


class _Versions:
    """Snapshots by version, filled by the receiver thread."""

    def __init__(self) -> None:
        self.snapshots: dict[int, _Snapshot] = {}
        self.error: BaseException | None = None
        self.cond = threading.Condition()

    def wait_for(self, version: int, stopped: Any) -> _Snapshot:
        with self.cond:
            while version not in self.snapshots:
                if self.error is not None:
                    raise RuntimeError(f"receiving weights failed: {self.error}") from self.error
                if stopped():
                    raise PoolStoppedError(f"version {version}")
                self.cond.wait(0.05)
            for old in [v for v in self.snapshots if v < version]:
                del self.snapshots[old]
            return self.snapshots[version]


def _receive(pool: Any, versions: _Versions) -> None:
    count = 0
    try:
        while True:
            sync = take(pool.store, f"sync/{count}", pool.stopped)
            version = sync["version"]
            snapshot = _Snapshot(dict(receive_weights(pool.weight_group, "cpu", pool.timeout)),
                                 sync["adapter_config"])
            with versions.cond:
                versions.snapshots[version] = snapshot
                versions.cond.notify_all()
            count += 1
    except PoolStoppedError:
        return
    except BaseException as exc:  # noqa: BLE001 - reported with the next job
        with versions.cond:
            versions.error = exc
            versions.cond.notify_all()


def _load(rollout: Any, version: int, snapshot: _Snapshot) -> None:
    """Version ``version`` into the rollout: merged tensors in place, or adapters as its LoRA version."""
    if snapshot.adapter_config is None:
        rollout.update_weights(snapshot.tensors.items())
    else:
        rollout.load_adapter(version, snapshot.tensors, snapshot.adapter_config)


def serve(pool: Any, mirrors: Mapping[str, Handler] | None = None) -> None:
    """Serve the trainer ranks ``r`` with ``pool.server_of(r) == pool.rank`` until ``stop``.

    Args:
        pool: This rollout rank's pool.
        mirrors: Kind -> handler of the mirrored calls (:mod:`.mirror`), run on a thread of their own.

    Raises:
        RuntimeError: A mirrored call failed or had no handler (after serving ended).
    """
    heartbeat = Heartbeat(pool.store, pool.rank)
    mirrored = Mirrors(pool, mirrors or {})
    rollout = build_rollout(pool.config, pool.model_path)
    versions = _Versions()
    receiver = threading.Thread(target=_receive, args=(pool, versions), name="rollout-pool-receiver",
                                daemon=True)
    receiver.start()
    served = [r for r in range(pool.trainers) if pool.server_of(r) == pool.rank]
    print(f"rollout rank {pool.rank} (pid {os.getpid()}) serves trainer ranks {served}", flush=True)
    loaded: int | None = None
    seq = 0
    try:
        while True:
            for trainer_rank in served:
                job = take(pool.store, f"job/{trainer_rank}/{seq}", pool.stopped)
                start = time.perf_counter()
                try:
                    snapshot = versions.wait_for(job["version"], pool.stopped)
                    if loaded != job["version"]:
                        _load(rollout, job["version"], snapshot)
                        loaded = job["version"]
                    rollout.data_rank = job["dp_rank"]
                    with torch.no_grad():
                        if "validation" in job:  # a validation batch: the validation seed stream
                            batch = rollout.generate(job["prompts"], step=job["step"], stream=1,
                                                     **job["validation"])
                        else:
                            batch = RolloutStage(rollout, None, job["dp_rank"]).sample(job["prompts"],
                                                                                     job["step"], {})
                    result = ("ok", batch, time.perf_counter() - start)
                except PoolStoppedError:
                    raise
                except Exception:  # noqa: BLE001 - the trainer rank raises it, naming this rank
                    result = ("error", traceback.format_exc(), time.perf_counter() - start)
                post(pool.store, f"result/{trainer_rank}/{seq}", result)
            seq += 1
    except PoolStoppedError:
        pass
    finally:
        heartbeat.stop()
        receiver.join(timeout=pool.config.weight_sync_timeout_s)
        if hasattr(rollout, "shutdown_engine"):  # vLLM: its groups go now, not in a finalizer at exit
            rollout.shutdown_engine()
    mirrored.finish(pool.config.weight_sync_timeout_s)
