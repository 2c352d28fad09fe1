"""Multi-node runs without Ray (issue 31 item 2): two simulated nodes on this machine equal one node.

``python recipes/grpo.py`` at ``devices=2`` (one node, the script launcher starts rank 1) is the reference.
The same run as ``devices=1 num_nodes=2``, started by

* two ``torchrun`` agents (``--nnodes=2``, c10d rendezvous on 127.0.0.1, each agent and its rank bound to
  127.0.0.1), or
* two processes with the variables ``srun`` sets on two nodes (``SLURM_PROCID``, ``SLURM_NODEID``,
  ``SLURM_NNODES``, ``SLURM_NODELIST``, ...; Lightning's ``SLURMEnvironment`` reads them),

logs exactly the same per-step rewards, losses and grad norms and ends with bitwise the same exported
weights. Every listening socket the two simulated nodes open is on 127.0.0.1 (checked while they run).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.recipes.test_recipes import RL_OVERRIDES, ROOT, assets  # noqa: F401  (fixture)
from tests.trainer.common import read_csv_metrics
from verl_trainer.testing.ranks import find_free_port
from verl_trainer.testing.sockets import LoopbackWatch

COMPARED = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean")
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "NODE_RANK", "GROUP_RANK", "VERL_TRAINER_LAUNCHER_PID", "TORCHELASTIC_RUN_ID")


def grpo_args(assets: Path, root: Path, *extra: str) -> list[str]:  # noqa: F811
    """``recipes/grpo.py`` and its overrides: 3 steps, an entropy bonus (a gradient well above round-off)."""
    return [
        str(ROOT / "recipes" / "grpo.py"),
        "trainer.max_steps=3", "trainer.val_check_interval=null", "trainer.logger=[csv]",
        "trainer.validate_before_fit=false", "trainer.enable_checkpointing=false",
        f"trainer.default_root_dir={root}", f"model.path={assets / 'model'}",
        "model.make_tiny_if_missing=false",
        f"task.dir={assets / 'data'}", "task.write_if_missing=false", "data.train_batch_size=4",
        "algorithm.rollout.n=2", *RL_OVERRIDES,
        "algorithm.actor.calculate_entropy=true", "algorithm.actor.loss.entropy_coeff=0.01", *extra,
    ]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's or scheduler's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    env.update(WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def run_nodes(commands: list[tuple[list[str], dict[str, str]]], timeout: float = 600) -> list[str]:
    """Start every (command, env) at once in its own session, watch their sockets, wait for all.

    Returns:
        Each command's output. Fails when one exits non-zero (every other one is killed) or listens on or
        connects to an address other than 127.0.0.1.
    """
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for cmd, env in commands]
    watch = LoopbackWatch([p.pid for p in procs])
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            watch.sample()
            failed = [p for p in procs if p.returncode not in (None, 0)]
            assert not failed and time.monotonic() < deadline, "a node failed or the run timed out"
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
        outs = [p.communicate(timeout=60)[0] for p in procs]
        if any(p.returncode for p in procs):
            pytest.fail("\n\n".join(f"node {i} exited {p.returncode}:\n{o[-4000:]}"
                                    for i, (p, o) in enumerate(zip(procs, outs))))
    watch.check()
    return outs


def assert_same_run(got: Path, want: Path) -> None:
    """Equal per-step metrics (exactly) and bitwise equal exported weights."""
    from safetensors.torch import load_file

    a, b = read_csv_metrics(got), read_csv_metrics(want)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    assert b[1]["actor/grad_norm"] > 1e-5
    for step in b:
        for key in COMPARED:
            assert a[step][key] == b[step][key], (step, key, a[step][key], b[step][key])
    wa, wb = load_file(got / "hf" / "model.safetensors"), load_file(want / "hf" / "model.safetensors")
    assert sorted(wa) == sorted(wb)
    assert all(wa[k].equal(wb[k]) for k in wb)


@pytest.fixture(scope="module")
def one_node(assets, tmp_path_factory) -> Path:  # noqa: F811
    """The reference: one node, ``devices=2`` (a plain ``python`` command)."""
    root = tmp_path_factory.mktemp("one_node")
    run_nodes([([sys.executable, *grpo_args(assets, root, "trainer.devices=2")], clean_env())])
    return root


@pytest.mark.slow
def test_two_torchrun_agents_equal_one_node(assets, one_node, tmp_path):  # noqa: F811
    port = find_free_port()
    args = grpo_args(assets, tmp_path, "trainer.devices=1", "trainer.num_nodes=2")

    def agent(is_host: bool) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=multinode_test",
                f"--rdzv-conf=is_host={str(is_host).lower()}", "--local-addr=127.0.0.1", "--max-restarts=0",
                "--monitor-interval=1", *args]

    outs = run_nodes([(agent(True), clean_env()), (agent(False), clean_env())])
    assert sum("after training" in o for o in outs) == 1, outs  # global rank 0 reports, on one node
    assert_same_run(tmp_path, one_node)


def slurm_env(proc_id: int, port: int) -> dict[str, str]:
    """What ``srun`` sets for task ``proc_id`` of a 2-node job, 1 task per node (the nodes: this host)."""
    return clean_env(
        SLURM_JOB_ID="4242", SLURM_JOB_NAME="grpo", SLURM_NTASKS="2", SLURM_NNODES="2",
        SLURM_NTASKS_PER_NODE="1", SLURM_PROCID=str(proc_id), SLURM_LOCALID="0", SLURM_NODEID=str(proc_id),
        SLURM_NODELIST="127.0.0.1", SLURM_JOB_NODELIST="127.0.0.1", MASTER_PORT=str(port),
    )


@pytest.mark.slow
def test_simulated_slurm_job_on_two_nodes_equals_one_node(assets, one_node, tmp_path):  # noqa: F811
    port = find_free_port()
    cmd = [sys.executable, *grpo_args(assets, tmp_path, "trainer.devices=1", "trainer.num_nodes=2")]
    outs = run_nodes([(cmd, slurm_env(0, port)), (cmd, slurm_env(1, port))])
    assert "after training" in outs[0] and "after training" not in outs[1]  # SLURM_PROCID 0 is rank 0
    assert_same_run(tmp_path, one_node)
