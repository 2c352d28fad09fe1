"""Gloo ranks kept alive between tests: ``world_size`` processes that run one rank function after another.

Starting a rank costs seconds (Python, torch and the test module's imports, the rendezvous); most
distributed tests run for less than that. A :class:`WorkerPool` pays it once: its processes join one
process group when the pool starts and then run each task ``fn(*args, **kwargs)`` on every rank.

Between tasks every rank puts back what a task may change and a later task would see: the environment
variables, the working directory, signal handlers, torch's default dtype, grad mode, deterministic
algorithms, intra-op threads, the default generator's seed (as a fresh process has them) and the entries of
the project's registries, and destroys the process groups the task created. A rank whose process can no
longer stand for a fresh one reports why and the pool is closed after the task (the next call starts a new
one): the default group was destroyed, DeepSpeed was imported (its process-wide set-up would reach later
tasks), or a Trainer's failure channel saw a failure. A task that raises, a rank that dies and a task past
its timeout close the pool too: a rank left inside a collective cannot be reused.

Invariants: a pool runs one task at a time, on all of its ranks; a task's result or error reaches the
caller with the rank's traceback; no process outlives :func:`close_worker_pools` (also run at exit).
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing as mp
import os
import pickle
import signal
import sys
import time
import traceback
import types
from collections import OrderedDict
from collections.abc import Callable, Hashable
from datetime import timedelta
from multiprocessing.connection import Connection, wait

from verl_trainer.testing.gc_freeze import freeze_survivors, imports_without_gc
from verl_trainer.utils import registry
from verl_trainer.utils.registry import Registry

MAX_POOLED_RANKS = 8
"""Live pooled processes at most (over all pools): a 1-, a 2- and a 4-rank pool, or any mix that fits. Each
holds torch, transformers and the test modules it imported (a few hundred MB)."""
PROCESS_GROUP_TIMEOUT_S = 1800.0
"""The pooled process group's collective timeout. The caller's own deadline (``timeout`` of a task) ends a
hung task first; this only bounds a rank left waiting after its caller is gone."""
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
"""Signals whose handlers a task may install (a Trainer's preemption handling) and a rank puts back."""
ERROR_GRACE_S = 2.0
"""After a rank's error, how long to wait for the others' (usually its consequences), earliest first."""


class PoolTaskError(RuntimeError):
    """A task raised on a rank, a rank died, or the task (or the pool's start) ran past its deadline.

    ``crash_signal``: the signal that killed a rank which died without a result (a native crash), else None.
    """

    def __init__(self, message: str, crash_signal: int | None = None) -> None:
        super().__init__(message)
        self.crash_signal = crash_signal


def crash_signal(exitcode: int | None) -> int | None:
    """The signal that ended a process with ``exitcode`` (multiprocessing's ``-signum``), else None."""
    return -exitcode if exitcode is not None and exitcode < 0 else None


def start_rank(rank: int, world_size: int, port: int, env: dict[str, str], backend: str,
               timeout_s: float) -> None:
    """Join ``rank`` of ``world_size`` to a process group at 127.0.0.1:``port``.

    Sets ``env`` and the rendezvous variables first, and one intra-op thread (ranks share the cores). A
    fatal signal (a native crash: SIGSEGV, SIGABRT from a corrupted heap) prints every thread's Python stack
    to the rank's stderr, which the test's captured output shows.

    Raises:
        Whatever ``torch.distributed.init_process_group`` raises (the caller reports it to the parent).
    """
    faulthandler.enable(all_threads=True)
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))


def _registries() -> dict[int, tuple[Registry, dict]]:
    """Every project registry held by a module or a class of one, with a copy of its entries.

    A task may register a name (a closure, a class defined in the task); a later task registering that
    name again would find it taken, which a fresh process never does.
    """
    found: dict[int, tuple[Registry, dict]] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("verl_trainer") or module is None:
            continue
        for value in list(vars(module).values()):
            held = list(vars(value).values()) if isinstance(value, type) else [value]
            for item in held:
                if isinstance(item, Registry) and id(item) not in found:
                    found[id(item)] = (item, dict(item._entries))
    return found


def _importing(frame: types.FrameType | None) -> bool:
    """Whether a module is being imported somewhere up the stack from ``frame``."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def _track_registrations(added: list[tuple[Registry, Hashable]],
                         imported: list[tuple[Registry, Hashable, object]]) -> None:
    """Make every project registry record what a task registers (``added``) and what a module registers.

    ``added`` gets ``(registry, key)`` for a new key a task registers; ``imported`` gets
    ``(registry, key, entry)`` for a key a module registers while it is imported.
    Registrations made while a module is imported (the import system's frames are on the stack, whichever
    decorator or helper registers: ``@register_rollout`` adds from a function of ``rollout/registry.py``) are
    the module's and stay, also in a registry imported before the task: the module stays imported. Only a
    task's own registrations are undone.
    """
    add = registry.Registry.add

    def tracked_add(self: Registry, key: Hashable, obj: object) -> object:
        new = key not in self._entries
        result = add(self, key, obj)
        if _importing(sys._getframe(1)):
            imported.append((self, key, self._entries[key]))
        elif new:
            added.append((self, key))
        return result

    registry.Registry.add = tracked_add


class _FreshState:
    """What a fresh rank process has and a task may change; :meth:`restore` puts it back.

    Returns from :meth:`restore`: ``None`` when the process can run another task, else the reason it
    cannot.
    """

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.dtype = torch.get_default_dtype()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.deterministic_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        self.seed = torch.initial_seed()
        self.groups = set(dist.distributed_c10d._world.pg_map)
        self.had_deepspeed = "deepspeed" in sys.modules
        self.handlers = {sig: signal.getsignal(sig) for sig in HANDLED_SIGNALS}
        self.added: list[tuple[Registry, Hashable]] = []
        self.imported: list[tuple[Registry, Hashable, object]] = []
        _track_registrations(self.added, self.imported)

    def before_task(self) -> None:
        """Remember the registries imported so far and their entries (a task may add, replace, remove).

        A registry first imported during the task loses only the keys the task itself registered.
        """
        self.registries = _registries()
        self.added.clear()
        self.imported.clear()

    def restore(self) -> str | None:
        import torch
        import torch.distributed as dist

        while self.added:
            registry, key = self.added.pop()
            registry._entries.pop(key, None)
        for registry, entries in self.registries.values():
            if registry._entries != entries:
                registry._entries.clear()
                registry._entries.update(entries)
        for registry, key, entry in self.imported:  # the modules the task imported keep theirs
            registry._entries[key] = entry
        self.imported.clear()

        if set(os.environ.items()) != set(self.environ.items()):
            os.environ.clear()
            os.environ.update(self.environ)
        if os.getcwd() != self.cwd:
            os.chdir(self.cwd)
        for sig, handler in self.handlers.items():
            if signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
        torch.set_default_dtype(self.dtype)
        torch.use_deterministic_algorithms(self.deterministic, warn_only=self.deterministic_warn_only)
        torch.set_grad_enabled(True)
        torch.set_num_threads(1)
        torch.manual_seed(self.seed)
        if not dist.is_initialized():
            return "the task destroyed the default process group"
        for group in list(dist.distributed_c10d._world.pg_map):
            if group not in self.groups:
                try:
                    dist.destroy_process_group(group)
                except Exception as err:  # noqa: BLE001 - the process is then replaced, not reused
                    return f"a process group the task created could not be destroyed: {err!r}"
        freeze_survivors()  # the task's garbage goes; what it imported is not walked again
        if "deepspeed" in sys.modules and not self.had_deepspeed:
            return "the task imported deepspeed (its process-wide set-up would reach later tasks)"
        failure = sys.modules.get("verl_trainer.training.failure")
        if failure is not None and getattr(failure._STATE, "seen", None) is not None:
            return "a Trainer's failure channel saw a failure"
        return None


def _dumps(payload: tuple) -> bytes:
    try:
        return pickle.dumps(payload)
    except Exception:  # an unpicklable result is an error too
        return pickle.dumps(("error", traceback.format_exc(), time.time(), payload[-1]))


def _serve(rank: int, world_size: int, port: int, conn: Connection, env: dict[str, str],
           backend: str) -> None:
    """A pooled rank: join the group, report ready, then run tasks until told to stop or the pipe closes.

    Every message back is ``(status, value, time, not_reusable_reason)`` with status ``ready``, ``ok``
    (value: the result) or ``error`` (value: the traceback).
    """
    try:
        with imports_without_gc():
            start_rank(rank, world_size, port, env, backend, PROCESS_GROUP_TIMEOUT_S)
        fresh = _FreshState()
        fresh.before_task()
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        conn.send_bytes(_dumps(("error", traceback.format_exc(), time.time(), "start failed")))
        return
    conn.send_bytes(_dumps(("ready", None, time.time(), None)))
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the caller is gone
            return
        try:
            with imports_without_gc():  # a task's first call imports its test module
                task = pickle.loads(message)
            if task is None:
                return
            fn, args, kwargs = task
            fresh.before_task()
            payload: tuple = ("ok", fn(*args, **kwargs), time.time())
        except BaseException:  # noqa: BLE001
            # The time of the failure (not of the clean-up) tells the first failing rank.
            payload = ("error", traceback.format_exc(), time.time())
        try:
            reason = fresh.restore()
        except BaseException:  # noqa: BLE001
            reason = "restoring the fresh state failed:\n" + traceback.format_exc()
        conn.send_bytes(_dumps((*payload, reason)))


def _receive(conn: Connection) -> tuple | None:
    """The rank's next message, or None when there is none (yet, or ever: its end of the pipe closed)."""
    try:
        return pickle.loads(conn.recv_bytes()) if conn.poll() else None
    except (EOFError, OSError):
        return None


class WorkerPool:
    """``world_size`` spawned processes in one process group of ``backend``, running tasks on every rank.

    Args:
        world_size: Number of ranks (>= 1).
        backend: Process-group backend (``"gloo"`` on CPU).
        env: Environment variables set in every rank before anything is imported.
        port: The rendezvous port (``MASTER_PORT``), free when asked.

    ``alive`` is False once the pool is closed; a closed pool runs nothing.
    """

    def __init__(self, world_size: int, backend: str, env: dict[str, str], port: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.alive = False
        self._started = False
        ctx = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            self._procs.append(ctx.Process(target=_serve, args=(rank, world_size, port, child, env, backend),
                                           name=f"pooled-rank{rank}"))
            self._conns.append(parent)
        for proc in self._procs:
            proc.start()
        self.alive = True

    def start(self, deadline: float) -> None:
        """Wait for every rank to join the group (by ``time.monotonic()`` ``deadline``).

        Raises:
            PoolTaskError: A rank failed to start (its traceback), died, or the deadline passed; the pool
                is closed.
        """
        self._gather(deadline, "never joined the process group")
        self._started = True

    def run(self, fn: Callable[..., object], args: tuple, kwargs: dict, timeout: float) -> list[object]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results.

        Raises:
            PoolTaskError: A rank raised (the earliest failure's traceback first), died without a result,
                or ``timeout`` seconds passed; the pool is closed.
        """
        deadline = time.monotonic() + timeout
        if not self._started:
            self.start(deadline)
        message = pickle.dumps((fn, args, kwargs))
        try:
            for conn in self._conns:
                conn.send_bytes(message)
        except BaseException as err:
            self.close()
            if isinstance(err, OSError):  # a rank is gone (its end of the pipe closed)
                raise PoolTaskError(f"a rank exited before the task reached it: {err!r}") from None
            raise
        results, reasons = self._gather(deadline, "never finished", timeout)
        if any(reasons):
            self.close()
        return results

    def _gather(self, deadline: float, late: str,
                timeout: float | None = None) -> tuple[list[object], list[str | None]]:
        """Every rank's next message by ``deadline``: ``(values, not-reusable reasons)`` in rank order.

        Raises:
            PoolTaskError: As :meth:`run` (``late`` says what the ranks missing at the deadline did not do);
                the pool is closed.
        """
        results: dict[int, object] = {}
        reasons: dict[int, str | None] = {}
        errors: list[tuple[float, int, str]] = []
        failure: str | None = None
        killed_by: int | None = None
        try:
            while len(results) < self.world_size and failure is None:
                pending = [r for r in range(self.world_size) if r not in results]
                waitables = [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending]
                ready = wait(waitables, timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    after = f" after {timeout:.0f}s" if timeout is not None else ""
                    failure = f"timed out{after}; ranks {pending} {late}"
                    break
                for rank in pending:
                    conn = self._conns[rank]
                    message = _receive(conn)
                    if message is not None:
                        status, value, when, reason = message
                        if status == "error":
                            errors.append((when, rank, value))
                            failure = "error"
                            break
                        results[rank], reasons[rank] = value, reason
                    elif not self._procs[rank].is_alive():
                        self._procs[rank].join()
                        code = self._procs[rank].exitcode
                        failure = f"rank {rank} exited with code {code} and no result"
                        killed_by = crash_signal(code)
                        break
            if failure == "error":
                errors.extend(self._late_errors(set(results) | {r for _, r, _ in errors}))
                errors.sort()
                failure = "\n".join(f"rank {rank} raised:\n{tb}" for _, rank, tb in errors)
        except BaseException:
            self.close()
            raise
        if failure is not None:
            self.close()
            raise PoolTaskError(failure, killed_by)
        return [results[r] for r in range(self.world_size)], [reasons[r] for r in range(self.world_size)]

    def _late_errors(self, done: set[int]) -> list[tuple[float, int, str]]:
        """The other ranks' errors that arrive within ``ERROR_GRACE_S``."""
        found = []
        deadline = time.monotonic() + ERROR_GRACE_S
        waiting = {r for r in range(self.world_size) if r not in done}
        while waiting and time.monotonic() < deadline:
            ready = wait([self._conns[r] for r in waiting], timeout=max(0.0, deadline - time.monotonic()))
            for rank in [r for r in waiting if self._conns[r] in ready]:
                waiting.discard(rank)
                message = _receive(self._conns[rank])
                if message is not None and message[0] == "error":
                    _, value, when, _ = message
                    found.append((when, rank, value))
        return found

    def close(self) -> None:
        """Stop every rank (a rank that does not stop within a second is killed) and free the pipes."""
        if not self.alive:
            return
        self.alive = False
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 1.0
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()


_POOLS: OrderedDict[tuple, WorkerPool] = OrderedDict()


def pooled_run(fn: Callable[..., object], world_size: int, args: tuple, kwargs: dict, *, timeout: float,
               backend: str, env: dict[str, str], port: Callable[[], int]) -> list[object]:
    """Run ``fn`` on the pool of ``(world_size, backend, env)``; return the per-rank results.

    A pool is started (its rendezvous port from ``port()``) when there is none; the least recently used
    pools are closed to stay within ``MAX_POOLED_RANKS``.

    Raises:
        PoolTaskError: As :meth:`WorkerPool.run` (the pool is then closed and forgotten).
    """
    key = (world_size, backend, tuple(sorted(env.items())))
    pool = _POOLS.pop(key, None)
    if pool is None or not pool.alive:
        while _POOLS and sum(p.world_size for p in _POOLS.values()) + world_size > MAX_POOLED_RANKS:
            _POOLS.popitem(last=False)[1].close()
        pool = WorkerPool(world_size, backend, env, port())
    results = pool.run(fn, args, kwargs, timeout)
    if pool.alive:
        _POOLS[key] = pool
    return results


def close_worker_pools() -> None:
    """Close every pool (their processes end)."""
    while _POOLS:
        _POOLS.popitem()[1].close()


atexit.register(close_worker_pools)
