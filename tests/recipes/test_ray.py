"""The GRPO recipe under Ray Train on a local two-node Ray cluster (issue 31 item 1); marker ``ray``.

The cluster is started by the test (a head node and one more node, each with one CPU, every process with
``node_ip_address=127.0.0.1``: :class:`LocalRayCluster`) and stopped by it: only the processes of its own
temporary directory are ended, by pid. While a run goes on, every socket of the cluster's processes and of
the driver is sampled (:class:`~verl_trainer.testing.sockets.LoopbackWatch`): none is bound or connected
to an address other than 127.0.0.1.

* ``examples/ray_grpo.py`` with 2 workers (one per node) equals ``python recipes/grpo.py`` at
  ``devices=2``: the same per-step metrics and bitwise the same exported weights; each checkpoint reached
  Ray's storage.
* A worker SIGKILLed once a checkpoint is reported: Ray restarts both workers, the run resumes from Ray's
  latest checkpoint and ends with bitwise the weights of the uninterrupted run.
* A separate rollout pool (``algorithm.rollout.placement=separate``: 1 trainer + 1 rollout worker, one step
  off, a checkpoint reported each step, which the rollout worker mirrors) equals ``recipes/grpo.py
  trainer.devices=2`` with the same pool: metrics, staleness ``0, 1, 1``, weights bitwise.
* The rollout worker SIGKILLed once a checkpoint is reported: Ray names rank 1, restarts both workers (a new
  rollout worker) and the run resumes and ends.

Needs the ``ray`` extra: ``scripts/ci_ray.sh`` installs it and runs these tests (``-m ray``; the marker
keeps them out of the other stages).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from tests.recipes.test_multinode import assert_same_run, clean_env, grpo_args, one_node  # noqa: F401
from tests.recipes.test_recipes import ROOT, assets  # noqa: F401  (fixture)
from verl_trainer.testing.ranks import find_free_port
from verl_trainer.testing.sockets import LoopbackWatch

# Each run takes 35-45 s on a quiet machine; on 2 cores under other load Ray took 5 min to start a worker
# group (measured 2026-12-04), so CI runs this stage alone, after the others (.ci/run).
RUN_LIMIT_S = 480
pytestmark = [pytest.mark.ray, pytest.mark.timeout(RUN_LIMIT_S + 300)]
EXAMPLE = ROOT / "examples" / "ray_grpo.py"


class LocalRayCluster:
    """A head node and one more node on this machine (Ray's ``cluster_utils.Cluster``, Ray's way to simulate
    nodes in tests), every process with ``node_ip_address=127.0.0.1``.

    ``ray start --node-ip-address=127.0.0.1`` cannot make a second node on the loopback: the CLI swaps a
    loopback address for the machine's own unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, and with that it
    refuses to join a node to a cluster. ``Cluster`` starts the same processes (GCS, raylets, agents) with the
    address as given; with that variable set in this process and the driver, no Ray process looks up another
    address.
    """

    def __init__(self) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths have a limit
        # RAY_TMPDIR: Ray's files (and the "current cluster" address file) in this directory, not /tmp/ray
        self.vars = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                     "RAY_TMPDIR": self.temp_dir}
        self.env = clean_env(**self.vars)
        self.cluster = None
        self.address = ""

    def start(self) -> None:
        from ray.cluster_utils import Cluster

        os.environ.update(self.vars)
        Path(self.temp_dir, "ray").mkdir()
        node = {"num_cpus": 1, "num_gpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False,
                "object_store_memory": 80 * 1024 * 1024}
        self.cluster = Cluster(initialize_head=True, shutdown_at_exit=True,
                               head_node_args={**node, "temp_dir": str(Path(self.temp_dir, "ray")),
                                               "gcs_server_port": find_free_port()})
        self.cluster.add_node(**node)
        self.address = self.cluster.address
        assert self.address.startswith("127.0.0.1:"), self.address

    def pids(self) -> list[int]:
        """The cluster's processes: those whose command line names its temporary directory or GCS address,
        and their descendants (the worker processes, which rename themselves ``ray::...``)."""
        found: set[int] = set()
        for proc in psutil.process_iter(["pid", "cmdline"]):
            cmdline = " ".join(proc.info["cmdline"] or ())
            if self.temp_dir in cmdline or (self.address and self.address in cmdline):
                found.add(proc.info["pid"])
                try:
                    found.update(c.pid for c in proc.children(recursive=True))
                except psutil.NoSuchProcess:
                    pass
        found.discard(os.getpid())
        return sorted(found)

    def train_worker_pids(self) -> list[int]:
        """This cluster's Ray Train worker actors (their process title names the actor class)."""
        pids = []
        for pid in self.pids():
            try:
                if "RayTrainWorker" in " ".join(psutil.Process(pid).cmdline()):
                    pids.append(pid)
            except psutil.NoSuchProcess:
                continue
        return pids

    def node_states(self) -> list[str]:
        """Whether each node's Ray processes all still run (for a failure message)."""
        nodes = self.cluster.list_all_nodes() if self.cluster is not None else []
        return [f"node {i}: processes alive={n.remaining_processes_alive()}" for i, n in enumerate(nodes)]

    def stop(self) -> None:
        """End this cluster's processes (and only them): Ray's shutdown, then any left, by pid."""
        if self.cluster is not None:
            self.cluster.shutdown()
        procs = []
        for pid in self.pids():
            try:
                procs.append(psutil.Process(pid))
                procs[-1].kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=10)
        for name in self.vars:
            os.environ.pop(name, None)
        shutil.rmtree(self.temp_dir, ignore_errors=True)  # made by this test


@pytest.fixture(scope="module")
def ray_cluster():
    cluster = LocalRayCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
    assert not cluster.pids(), "Ray processes left behind"


def ray_command(cluster: LocalRayCluster, assets: Path, root: Path, *extra: str) -> list[str]:  # noqa: F811
    return [sys.executable, str(EXAMPLE), f"--address={cluster.address}", "--node-ip-address=127.0.0.1",
            f"--storage-path={root / 'ray_results'}", "--name=grpo_test", "--max-failures=1",
            *grpo_args(assets, root, "trainer.devices=1", "trainer.num_nodes=2",
                       "trainer.enable_checkpointing=true", "trainer.checkpoint.every_n_train_steps=1",
                       "trainer.checkpoint.keep_last_k=1")[1:],
            *extra]


def run_watched(cluster: LocalRayCluster, cmd: list[str], kill_when=None,
                timeout: float = RUN_LIMIT_S) -> str:
    """Run the driver, sampling every socket of it and of the cluster; ``kill_when()`` -> pid to SIGKILL.

    The driver's output goes to a file (a pipe nobody reads while the run goes on could fill and stall it);
    a run past ``timeout`` is ended and its output's end and the cluster's node states are in the failure.
    """
    log_path = Path(cluster.temp_dir) / f"driver_{time.monotonic_ns()}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=cluster.env, stdout=log, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
    watch = LoopbackWatch([proc.pid])
    killed = None
    started = time.monotonic()
    try:
        while proc.poll() is None and time.monotonic() - started < timeout:
            watch.roots = [proc.pid, *cluster.pids()]
            watch.sample()
            if kill_when is not None and killed is None:
                killed = kill_when()
                if killed is not None:
                    os.kill(killed, signal.SIGKILL)
            time.sleep(0.2)
    finally:
        timed_out = proc.poll() is None
        if timed_out:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        out = log_path.read_text()
    assert not timed_out, (f"the Ray run did not end in {timeout:.0f} s (killed worker: {killed}); nodes: "
                           f"{cluster.node_states()}; the driver's output ends with:\n{out[-6000:]}")
    assert proc.returncode == 0, out[-6000:]
    watch.check()
    assert kill_when is None or killed is not None, "no worker was killed"
    return out


def test_grpo_under_ray_equals_plain_two_devices(one_node, ray_cluster, assets, tmp_path):  # noqa: F811
    out = run_watched(ray_cluster, ray_command(ray_cluster, assets, tmp_path))
    assert "ray run done: 2 workers" in out, out[-3000:]
    assert_same_run(tmp_path, one_node)
    stored = sorted(p.name for p in (tmp_path / "ray_results" / "grpo_test").glob("step_*"))
    assert stored == ["step_000001", "step_000002", "step_000003"], stored
    assert (tmp_path / "ray_results" / "grpo_test" / "step_000003" / "trainer_state.pt").is_file()


def test_a_killed_worker_is_restarted_and_the_run_resumes(one_node, ray_cluster, assets, tmp_path):  # noqa: F811
    stored = tmp_path / "ray_results" / "grpo_test"

    def kill_after_first_report() -> int | None:
        if not (stored / "step_000001" / "trainer_state.pt").is_file():
            return None
        workers = ray_cluster.train_worker_pids()
        return workers[-1] if len(workers) == 2 else None

    out = run_watched(ray_cluster, ray_command(ray_cluster, assets, tmp_path),
                      kill_when=kill_after_first_report)
    assert "resuming from this Ray run's latest checkpoint" in out, out[-6000:]
    assert "ray run done: 2 workers" in out, out[-3000:]
    assert_same_run(tmp_path, one_node)


POOL = ("algorithm.rollout.placement=separate", "algorithm.rollout.rollout_ranks=1",
        "algorithm.rollout.max_staleness=1", "algorithm.rollout_correction.level=token")


def test_a_separate_rollout_pool_under_ray_equals_the_plain_launch(ray_cluster, assets, tmp_path):  # noqa: F811
    """2 Ray workers, the second one a rollout worker (``placement=separate``), one step off, a checkpoint
    reported each step (the rollout worker mirrors each report, else Ray's barrier blocks the first): the
    same metrics, staleness and weights as ``recipes/grpo.py trainer.devices=2`` with the same pool."""
    from tests.recipes.test_multinode import run_nodes
    from tests.trainer.common import read_csv_metrics

    plain = tmp_path / "plain"
    run_nodes([([sys.executable, *grpo_args(assets, plain, "trainer.devices=2", *POOL)], clean_env())])
    ray_root = tmp_path / "ray"
    out = run_watched(ray_cluster, ray_command(ray_cluster, assets, ray_root, *POOL))
    assert "ray run done: 2 workers" in out, out[-3000:]
    assert_same_run(ray_root, plain)
    for root in (ray_root, plain):  # step 1 sampled by version 0, steps 2 and 3 by the version before theirs
        metrics = read_csv_metrics(root)
        assert [metrics[s]["rollout/staleness"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0], metrics
    stored = sorted(p.name for p in (ray_root / "ray_results" / "grpo_test").glob("step_*"))
    assert stored == ["step_000001", "step_000002", "step_000003"], stored


def test_a_killed_rollout_worker_is_restarted_and_the_run_resumes(ray_cluster, assets, tmp_path):  # noqa: F811
    """The rollout worker (world rank 1) SIGKILLed once the first checkpoint is reported: Ray names the rank
    that failed, restarts both workers with the same split, and the run resumes from a checkpoint and ends
    (Ray sees the actor die before the pool's weight_sync_timeout_s check would fire)."""
    import re

    from tests.trainer.common import read_csv_metrics

    ray_root = tmp_path / "ray"
    stored = ray_root / "ray_results" / "grpo_test"
    serving = re.compile(r"rollout rank 1 \(pid (\d+)\) serves trainer ranks \[0\]")

    def kill_the_rollout_worker() -> int | None:
        if not (stored / "step_000001" / "trainer_state.pt").is_file():
            return None
        logs = sorted(Path(ray_cluster.temp_dir).glob("driver_*.log"))
        found = serving.findall(logs[-1].read_text()) if logs else []
        return int(found[-1]) if found else None

    out = run_watched(ray_cluster, ray_command(ray_cluster, assets, ray_root, *POOL),
                      kill_when=kill_the_rollout_worker)
    assert "[Rank 1 Error Snippet]" in out and "The actor died unexpectedly" in out, out[-6000:]
    assert len(set(serving.findall(out))) == 2, out[-6000:]  # a second rollout worker after the restart
    assert "resuming from this Ray run's latest checkpoint" in out, out[-6000:]
    assert "ray run done: 2 workers" in out, out[-3000:]
    assert (stored / "step_000003" / "trainer_state.pt").is_file()
    assert sorted(read_csv_metrics(ray_root)) == [1, 2, 3]
