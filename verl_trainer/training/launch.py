"""Joining or starting the process world: Lightning's cluster environments and script launcher.

Every rank runs the same script (SPMD). The ranks come from one of:

* a plain ``python script.py`` with ``Trainer(devices=N)``: :class:`ScriptLauncher` (Lightning's
  ``_SubprocessScriptLauncher``) re-runs the same command N-1 times with ``LOCAL_RANK=1..N-1`` (and
  ``MASTER_ADDR`` / ``MASTER_PORT`` / ``WORLD_SIZE`` / ``NODE_RANK``); the parent is rank 0 and the children
  join when they reach ``fit``, so scripts need an ``if __name__ == "__main__":`` guard, as with Lightning;
* torchrun, SLURM (``srun``), LSF: :func:`select_cluster_environment` detects them (Lightning's
  environments, in its order) and every process joins; ``devices`` / ``num_nodes`` are checked against
  the world (``validate_settings``);
* an initialised process group (a test harness): joined as is.

:func:`connect` initialises the process group (gloo on CPU, nccl on CUDA) through ``env://`` and keeps it
for later ``fit`` / ``validate`` calls of the same script. Ending every rank when one fails:
:mod:`verl_trainer.training.failure`.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import (
    ClusterEnvironment,
    LightningEnvironment,
    LSFEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from lightning.fabric.strategies.launchers.subprocess_script import (
    _ChildProcessObserver,
    _SubprocessScriptLauncher,
)

from verl_trainer.training import failure
from verl_trainer.utils.distributed import is_initialized, set_collective_timeout
from verl_trainer.utils.threads import set_intra_op_threads

__all__ = ["ScriptLauncher", "World", "connect", "select_cluster_environment"]

_R = TypeVar("_R")

REAP_AFTER_FAILURE_S = 2.0
"""After a failed run, how long rank 0 waits for its children to end before it exits."""
RENDEZVOUS_TIMEOUT = timedelta(minutes=5)
"""How long the ranks may take to start and meet (slow imports on a busy node), however short the
collective timeout is."""


@dataclass(frozen=True)
class World:
    """Where this process sits in the process world.

    Attributes:
        rank: Global rank.
        local_rank: Rank on this node (selects the GPU).
        world_size: Number of processes.
        node_rank: Index of this node.
        backend: Collective backend of the default process group (``"gloo"`` / ``"nccl"``).
    """

    rank: int
    local_rank: int
    world_size: int
    node_rank: int
    backend: str

    @property
    def is_global_zero(self) -> bool:
        """True on global rank 0 (the rank that logs and shows the progress bar)."""
        return self.rank == 0


def select_cluster_environment() -> ClusterEnvironment:
    """The first of Lightning's managed environments that detects itself, else LightningEnvironment.

    Order as in Lightning: SLURM, torchelastic (torchrun), LSF (Kubeflow cannot detect itself).
    """
    for env_cls in (SLURMEnvironment, TorchElasticEnvironment, LSFEnvironment):
        if env_cls.detect():
            return env_cls()
    return LightningEnvironment()


class _Observer(_ChildProcessObserver):
    """Lightning's child observer, but a dead child ends every rank with a message, not a bare SIGKILL.

    When a child exits with a non-zero code it posts ``rank r exited with code c`` to the failure
    channel (unless that rank posted its own error), gives the surviving ranks
    :data:`~verl_trainer.training.failure.FAILURE_GRACE_S` to end with that error, then kills what is
    left, this process included.
    """

    def __init__(self, launcher: ScriptLauncher, sleep_period: float = 1.0) -> None:
        super().__init__(main_pid=os.getpid(), child_processes=launcher.procs, sleep_period=sleep_period)
        self._launcher = launcher

    def _terminate_all(self) -> None:
        dead = [(i + 1, p) for i, p in enumerate(self._child_processes) if p.returncode]
        if dead:
            rank, proc = dead[0]
            failure.report_dead_rank(rank, proc.returncode)
        deadline = time.monotonic() + failure.FAILURE_GRACE_S
        main = threading.main_thread()
        while time.monotonic() < deadline and main.is_alive():
            time.sleep(0.2)
        if not main.is_alive():
            return  # the main thread raised the failing rank's error; atexit reaps the children
        self._launcher.kill(signal.SIGKILL)
        failure.hard_exit(failure.current_message() or "a child process failed")


class ScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess script launcher with an observer that propagates errors.

    Starts ``num_processes - 1`` copies of the running command on this node (only when the cluster
    environment does not create the processes itself), then calls the function in this process. At
    interpreter exit rank 0 waits for its children (they finish the same script), unless a run failed.
    """

    def launch(self, function: Callable[..., _R], *args: Any, **kwargs: Any) -> _R:
        """Start the children (once per script), then call ``function(*args, **kwargs)`` here."""
        env = self.cluster_environment
        env.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not env.creates_processes_externally and self.num_processes > 1 and not self.procs:
            os.environ[failure.LAUNCHER_PID_ENV] = str(os.getpid())  # children watch their launcher
            self._call_children_scripts()
            _Observer(self).start()
            atexit.register(self._reap_children)
        set_intra_op_threads(self.num_processes)  # the node's CPUs shared by its ranks; OMP_NUM_THREADS wins
        return function(*args, **kwargs)

    def kill(self, signum: int) -> None:
        """Send ``signum`` to every child still running."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.send_signal(signum)
                except ProcessLookupError:
                    pass

    def _reap_children(self) -> None:
        """At exit: wait for the children to finish the script; after a failed run, leave at once.

        After a failure, this process exiting closes its connections, so children blocked in a collective
        with it fail immediately; a child still running then notices that its launcher is gone and ends
        with the failing rank's message (``training/failure.py``).
        """
        if failure.run_failed():  # give the children a moment to end first (they use our store)
            deadline = time.monotonic() + REAP_AFTER_FAILURE_S
            while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
                time.sleep(0.1)
            return
        for proc in self.procs:
            proc.wait()


_LAUNCHER: ScriptLauncher | None = None


def launcher_for(env: ClusterEnvironment, devices: int, num_nodes: int) -> ScriptLauncher:
    """The process-wide launcher: children are started once per script, however many fits it runs.

    Raises:
        ValueError: If children were started for another ``devices`` / ``num_nodes``.
    """
    global _LAUNCHER
    if _LAUNCHER is not None and _LAUNCHER.procs:
        if (_LAUNCHER.num_processes, _LAUNCHER.num_nodes) != (devices, num_nodes):
            raise ValueError(
                f"this script already started its processes for devices={_LAUNCHER.num_processes}, "
                f"num_nodes={_LAUNCHER.num_nodes}; every Trainer of one script must use the same values "
                f"(got devices={devices}, num_nodes={num_nodes})"
            )
        return _LAUNCHER
    _LAUNCHER = ScriptLauncher(env, num_processes=devices, num_nodes=num_nodes)
    return _LAUNCHER


def _current_world(backend: str | None = None) -> World:
    rank = dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    return World(
        rank=rank,
        local_rank=local_rank,
        world_size=dist.get_world_size(),
        node_rank=int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", 0))),
        backend=backend or dist.get_backend(),
    )


def connect(
    env: ClusterEnvironment, devices: int, num_nodes: int, backend: str, timeout: timedelta
) -> World:
    """Initialise the default process group for this rank (or join the one that exists).

    Args:
        env: The cluster environment (:func:`select_cluster_environment`).
        devices: Processes per node.
        num_nodes: Nodes.
        backend: ``"gloo"`` or ``"nccl"``.
        timeout: Collective timeout of the process group.

    Returns:
        This rank's :class:`World`.

    Raises:
        ValueError: If an existing process group's size is not ``devices * num_nodes``.
    """
    expected = devices * num_nodes
    if is_initialized():
        world = _current_world()
        if world.world_size != expected:
            raise ValueError(
                f"a process group of {world.world_size} ranks is already initialised, but the Trainer was "
                f"configured for devices={devices} x num_nodes={num_nodes} = {expected}; make them match"
            )
    else:
        node_rank = env.node_rank()
        env.set_global_rank(node_rank * devices + env.local_rank())
        env.set_world_size(expected)
        rank, world_size = env.global_rank(), env.world_size()
        os.environ["MASTER_ADDR"] = env.main_address
        os.environ["MASTER_PORT"] = str(env.main_port)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(env.local_rank()))
        os.environ.setdefault("NODE_RANK", str(node_rank))
        if backend == "nccl":
            torch.cuda.set_device(env.local_rank())
        # the timeout also bounds the rendezvous: meet with a generous one, then set the collectives' own
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=max(timeout, RENDEZVOUS_TIMEOUT))
        set_collective_timeout(timeout)
        world = _current_world(backend)
    if world.backend == "nccl":
        torch.cuda.set_device(world.local_rank)
    _set_rank_zero_only(world.rank)
    failure.start_watchdog(world.rank, world.world_size, timeout)
    return world


def _set_rank_zero_only(rank: int) -> None:
    """Make Lightning's ``rank_zero_only`` (loggers, warnings) agree with the real global rank."""
    from lightning_utilities.core.rank_zero import rank_zero_only

    rank_zero_only.rank = rank


def _is_interactive() -> bool:
    import __main__

    return not hasattr(__main__, "__file__") and __main__.__spec__ is None


def check_launchable(env: ClusterEnvironment, devices: int, num_nodes: int) -> None:
    """Refuse a world of several processes that a plain script launch cannot start.

    Raises:
        ValueError: Several processes from an interactive session, or ``num_nodes > 1`` with no cluster
            launcher.
    """
    if devices * num_nodes > 1 and not env.creates_processes_externally and not is_initialized():
        if _is_interactive():
            raise ValueError(
                f"devices={devices} x num_nodes={num_nodes} needs several processes, which are "
                f"started by re-running the script: run it as `python script.py` (or torchrun), not "
                f"from an interactive session"
            )
        if num_nodes > 1:
            raise ValueError(
                "num_nodes > 1 needs a cluster launcher (torchrun, SLURM's srun, ...) that starts the "
                "processes on every node; with a plain `python script.py` use num_nodes=1"
            )
