"""CPU thread defaults of the commands: idle OpenMP threads sleep, and the intra-op threads fit the CPUs.

torch's CPU kernels run on an OpenMP team (GNU libgomp). By default a libgomp thread that waits (for work,
or at the barrier that ends a parallel region) spins for a while before it sleeps. On a machine whose cores
are all busy, the spinning thread takes a core's time slice from the thread that holds the work, so every
parallel region waits for the scheduler: the default GRPO demo ran tens of times slower per step on a busy
two-core machine. With ``OMP_WAIT_POLICY=PASSIVE`` a waiting thread sleeps at once and the degradation is
about the machine's share, not the spin (the figures: README, "The default run"; docs/reliability.md).

Two settings, each applied only where the user has not set their own:

* :func:`apply_thread_env_defaults` (the commands' entry points, before torch is imported): sets
  ``OMP_WAIT_POLICY=PASSIVE`` unless ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is set. libgomp reads both
  once, when it loads with torch; set later, they only reach child processes.
* :func:`set_intra_op_threads` (the launcher, once the local process count is known): torch's intra-op
  threads are the CPUs this process may run on (its affinity mask) divided by the processes of this node,
  at least 1, unless ``OMP_NUM_THREADS`` is set; the count is written to ``OMP_NUM_THREADS`` so that
  processes started later (reward workers, tools) share the same budget.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

__all__ = ["WAIT_POLICY_DEFAULT", "apply_thread_env_defaults", "available_cpus", "intra_op_threads",
           "set_intra_op_threads"]

WAIT_POLICY_DEFAULT = {"OMP_WAIT_POLICY": "PASSIVE"}
"""Set by :func:`apply_thread_env_defaults` when neither ``OMP_WAIT_POLICY`` nor ``GOMP_SPINCOUNT`` is."""
_USER_WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def apply_thread_env_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Make idle OpenMP threads sleep instead of spinning, unless the user chose how they wait.

    Call it before ``torch`` is imported: libgomp reads the variables once, when it loads.

    Args:
        environ: The environment to update (default ``os.environ``).

    Returns:
        The variables this call set (empty when the user set ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``).
    """
    env = os.environ if environ is None else environ
    if any(name in env for name in _USER_WAIT_SETTINGS):
        return {}
    env.update(WAIT_POLICY_DEFAULT)
    return dict(WAIT_POLICY_DEFAULT)


def available_cpus() -> int:
    """The CPUs this process may run on: its affinity mask where the OS has one, else ``os.cpu_count()``."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def intra_op_threads(local_processes: int, environ: MutableMapping[str, str] | None = None) -> int:
    """The intra-op thread count for one of ``local_processes`` processes on this node.

    Args:
        local_processes: Training processes on this node (``>= 1``).
        environ: The environment to read ``OMP_NUM_THREADS`` from (default ``os.environ``).

    Returns:
        ``OMP_NUM_THREADS`` when it is set to a positive integer, else ``max(1, available_cpus() //
        local_processes)``.

    Raises:
        ValueError: If ``local_processes < 1``.
    """
    if local_processes < 1:
        raise ValueError(f"local_processes must be >= 1, got {local_processes}")
    env = os.environ if environ is None else environ
    user = env.get("OMP_NUM_THREADS", "").strip()
    if user.isdigit() and int(user) > 0:
        return int(user)
    return max(1, available_cpus() // local_processes)


def set_intra_op_threads(local_processes: int) -> int:
    """Set torch's intra-op threads to :func:`intra_op_threads` and, when unset, ``OMP_NUM_THREADS`` to match.

    Args:
        local_processes: Training processes on this node (``>= 1``).

    Returns:
        The thread count set.
    """
    import torch  # lazy: the entry points import this module before torch may load (see the module doc)

    threads = intra_op_threads(local_processes)
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    return threads
