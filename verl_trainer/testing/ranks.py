"""Run a function on N real processes joined in a gloo process group (CPU), for tests.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, each of which sets
``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` (a free port), joins a gloo
process group, calls ``fn(*args, **kwargs)`` and sends its return value back. It returns the list of
per-rank results. An exception on any rank, a rank that dies, or a run past ``timeout`` fails with
:class:`DistributedTestError` carrying the failing rank's traceback; every remaining process is killed,
so none is left behind.

``fn`` and its arguments must be picklable (a module-level function). Each rank uses one intra-op
thread, so a 4-rank test does not oversubscribe a 2-core machine.

With :func:`use_worker_pool` on (the test suite turns it on; ``VERL_TRAINER_TEST_WORKER_POOL=0`` turns it
off again), the ranks are the processes of a :class:`~verl_trainer.testing.worker_pool.WorkerPool` kept
alive between calls of the same ``(world_size, backend, env)``: the same contract, without paying for the
process start-up on every call (see that module for what is reset between calls).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import random
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verl_trainer.testing.gc_freeze import imports_without_gc
from verl_trainer.testing.worker_pool import (
    PoolTaskError,
    close_worker_pools,
    crash_signal,
    pooled_run,
    start_rank,
)


class DistributedTestError(RuntimeError):
    """A rank raised, died, or the run timed out.

    ``crash_signal``: the signal that killed a rank which died without a result (a native crash: SIGSEGV,
    SIGABRT), else None (a Python error, a time-out, a rank that exited on its own).
    """

    def __init__(self, message: str, crash_signal: int | None = None) -> None:
        super().__init__(message)
        self.crash_signal = crash_signal


POOL_ENV = "VERL_TRAINER_TEST_WORKER_POOL"
"""``0`` keeps every call on fresh processes even where :func:`use_worker_pool` turned the pool on."""
_USE_POOL = False


def use_worker_pool(on: bool = True) -> None:
    """Run later ``run_distributed`` calls on pooled ranks (``on``) or on fresh processes per call.

    Turning it off closes the pools.
    """
    global _USE_POOL
    _USE_POOL = on
    if not on:
        close_worker_pools()


def _pool_on() -> bool:
    return _USE_POOL and os.environ.get(POOL_ENV, "1") != "0"


LISTEN_PORTS = (20000, 32768)
"""Where :func:`find_free_port` looks: below Linux's default ephemeral range (32768-60999), which the kernel
hands to outgoing connections and to ``bind(0)``. A port there that was free when asked can be taken by
one of the many gloo connections of another test before the rendezvous binds it (EADDRINUSE, seen with
two CI lanes running); a port below the range can only be taken by another caller that drew the same one."""


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return LISTEN_PORTS[1]


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free when asked.

    Drawn from :data:`LISTEN_PORTS`, below the kernel's ephemeral range; ``bind(0)``'s port when that range
    leaves no room.
    """
    low, high = LISTEN_PORTS[0], min(LISTEN_PORTS[1], _ephemeral_low())
    draw = random.SystemRandom()
    for _ in range(64 if high - low > 1000 else 0):
        port = draw.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    task: bytes,
    env: dict[str, str],
    backend: str,
    collective_timeout_s: float,
) -> None:
    out = Path(out_dir) / f"rank{rank}.pkl"
    try:
        with imports_without_gc():  # the test module's imports: what they make lives as long as the rank
            start_rank(rank, world_size, port, env, backend, collective_timeout_s)
            fn, args, kwargs = pickle.loads(task)
        import torch.distributed as dist

        try:
            payload = ("ok", fn(*args, **kwargs), time.time())
        except BaseException:  # noqa: BLE001 - everything goes back to the parent
            # The time of the failure (not of the teardown) tells the first failing rank.
            payload = ("error", traceback.format_exc(), time.time())
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        payload = ("error", traceback.format_exc(), time.time())
    tmp = out.with_suffix(".tmp")
    try:
        tmp.write_bytes(pickle.dumps(payload))
    except Exception:  # an unpicklable result is an error too
        tmp.write_bytes(pickle.dumps(("error", traceback.format_exc(), time.time())))
    tmp.rename(out)


def _collect_errors(out_dir: str, procs: list, grace_s: float = 2.0) -> str:
    """All ranks' errors, earliest failure first (the others are usually its consequences)."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(
        p.is_alive() and not (Path(out_dir) / f"rank{r}.pkl").exists() for r, p in enumerate(procs)
    ):
        time.sleep(0.05)
    errors = []
    for rank in range(len(procs)):
        path = Path(out_dir) / f"rank{rank}.pkl"
        if path.exists():
            status, value, when = pickle.loads(path.read_bytes())
            if status == "error":
                errors.append((when, rank, value))
    errors.sort()
    return "\n".join(f"rank {rank} raised:\n{tb}" for _, rank, tb in errors)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 240.0,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks and return the per-rank results.

    Args:
        fn: A picklable (module-level) function; it runs after ``init_process_group``.
        world_size: Number of processes (ranks).
        *args: Positional arguments for ``fn`` (picklable).
        timeout: Seconds for the whole run; past it every rank is killed and the test fails.
        backend: Process-group backend (``"gloo"`` on CPU).
        env: Extra environment variables set in every rank before anything is imported.
        **kwargs: Keyword arguments for ``fn``.

    Returns:
        ``[result_of_rank_0, ..., result_of_rank_{world_size-1}]``.

    Raises:
        DistributedTestError: If a rank raised (its traceback is in the message), died without a
            result, or the run exceeded ``timeout``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if _pool_on():
        try:
            return pooled_run(fn, world_size, args, kwargs, timeout=timeout, backend=backend,
                              env=dict(env or {}), port=find_free_port)
        except PoolTaskError as err:
            raise DistributedTestError(str(err), err.crash_signal) from None
    ctx = mp.get_context("spawn")
    port = find_free_port()
    task = pickle.dumps((fn, args, kwargs))  # unpickled (its module imported) by the rank, see _worker
    with tempfile.TemporaryDirectory(prefix="verl_dist_") as out_dir:
        procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, port, out_dir, task, dict(env or {}), backend,
                      max(timeout, 1.0)),
                name=f"rank{rank}",
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        failure: str | None = None
        killed_by: int | None = None
        try:
            while len(results) < world_size and failure is None:
                for rank, p in enumerate(procs):
                    if rank in results:
                        continue
                    path = Path(out_dir) / f"rank{rank}.pkl"
                    if path.exists():
                        status, value, _ = pickle.loads(path.read_bytes())
                        if status == "error":
                            failure = _collect_errors(out_dir, procs)
                            break
                        results[rank] = value
                    elif not p.is_alive() and not path.exists():
                        p.join()
                        if not path.exists():
                            failure = f"rank {rank} exited with code {p.exitcode} and no result"
                            killed_by = crash_signal(p.exitcode)
                            break
                if failure is None and len(results) < world_size:
                    if time.monotonic() > deadline:
                        missing = [r for r in range(world_size) if r not in results]
                        failure = f"timed out after {timeout:.0f}s; ranks {missing} never finished"
                    else:
                        time.sleep(0.02)
        finally:
            for p in procs:
                if p.is_alive():
                    p.join(timeout=0.5 if failure is None else 0.0)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
        if failure is not None:
            raise DistributedTestError(failure, killed_by)
    return [results[r] for r in range(world_size)]
