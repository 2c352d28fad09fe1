"""The pooled ranks behind ``run_distributed`` in the suite: reuse, the state put back between calls, and
a failing, hanging or dying rank (real processes)."""

import os
import signal
import sys
import time
import types

import pytest
import torch
import torch.distributed as dist

from verl_trainer.testing import DistributedTestError, find_free_port, run_distributed
from verl_trainer.testing.ranks import POOL_ENV
from verl_trainer.testing.worker_pool import WorkerPool, close_worker_pools


def _pid():
    return os.getpid()


def _dirty_state():
    os.environ["VERL_POOL_TEST_LEFTOVER"] = "1"
    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(123)
    os.chdir("/")
    signal.signal(signal.SIGUSR1, lambda *_: None)
    group = dist.new_group([0, 1])
    return len(dist.distributed_c10d._world.pg_map) > 1 and group is not None


def _state():
    return (os.environ.get("VERL_POOL_TEST_LEFTOVER"), torch.get_default_dtype(),
            torch.are_deterministic_algorithms_enabled(), torch.rand(1).item(), os.getcwd(),
            len(dist.distributed_c10d._world.pg_map), os.environ["RANK"], os.environ["WORLD_SIZE"],
            signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL)


def _register_a_new_optimizer():
    from verl_trainer.engine.optimizers import OPTIMIZERS

    OPTIMIZERS.add("pool_test_optimizer", type("Fresh", (torch.optim.SGD,), {}))
    return "pool_test_optimizer" in OPTIMIZERS


def _import_a_module_that_registers(directory: str) -> bool:
    """Import (first time in this process) a module whose decorator factory registers from a function."""
    sys.path.insert(0, directory)
    try:
        import pool_test_plugin  # noqa: F401  (registers "pool_test_plugin_optimizer" when imported)
    finally:
        sys.path.remove(directory)
    from verl_trainer.engine.optimizers import OPTIMIZERS

    return "pool_test_plugin_optimizer" in OPTIMIZERS


def _still_registered() -> bool:
    from verl_trainer.engine.optimizers import OPTIMIZERS

    return "pool_test_plugin_optimizer" in OPTIMIZERS


def _fake_deepspeed_import():
    sys.modules["deepspeed"] = types.ModuleType("deepspeed")
    return os.getpid()


def _destroy_world():
    dist.destroy_process_group()
    return os.getpid()


def _raise_on_rank1():
    if dist.get_rank() == 1:
        raise KeyError("boom-on-rank-1")
    dist.barrier()
    return "unreachable"


def _hang_on_rank0():
    if dist.get_rank() == 0:
        time.sleep(3600)
    dist.barrier()


@pytest.fixture(autouse=True, scope="module")
def _fresh_pools():
    """No pool of another test file at the start or left at the end; within this file the tests share
    pools as the suite's calls do (a pool that ran earlier tasks is what a later call gets): each process
    start costs seconds of CPU (torch's import), and a test that needs new processes asserts it gets them."""
    close_worker_pools()
    yield
    close_worker_pools()


def test_calls_of_one_world_size_reuse_the_same_processes():
    first = run_distributed(_pid, 2)
    assert run_distributed(_pid, 2) == first
    assert len(set(first)) == 2 and os.getpid() not in first
    assert set(run_distributed(_pid, 4)).isdisjoint(first)  # another world size: another pool
    assert run_distributed(_pid, 2) == first  # 2 + 4 ranks fit: both pools stay
    assert run_distributed(_pid, 1)[0] not in first
    assert run_distributed(_pid, 2) == first  # and a 1-rank pool beside them


def test_another_env_gets_its_own_processes():
    plain = run_distributed(_pid, 2)
    assert set(run_distributed(_pid, 2, env={"DS_ACCELERATOR": "cpu"})).isdisjoint(plain)


def test_a_call_sees_the_state_of_a_fresh_process():
    fresh = run_distributed(_state, 2)
    assert run_distributed(_dirty_state, 2) == [True, True]
    assert run_distributed(_state, 2) == fresh
    assert fresh[0][:3] == (None, torch.float32, False) and fresh[0][5] == 1 and fresh[0][8]


def test_a_name_registered_by_a_call_is_free_again_for_the_next():
    assert run_distributed(_register_a_new_optimizer, 2) == [True, True]
    assert run_distributed(_register_a_new_optimizer, 2) == [True, True]


def test_what_a_module_registers_when_a_call_imports_it_stays_registered(tmp_path):
    """A registration made while a module is imported is the module's (it stays imported), even when a
    decorator factory defined in another file makes it (as ``@register_rollout("hf")`` does) and the
    registry was imported by an earlier call."""
    (tmp_path / "pool_test_plugin.py").write_text(
        "import torch\n"
        "from verl_trainer.engine.optimizers import OPTIMIZERS\n\n"
        "def register(name):\n"
        "    def deco(cls):\n"
        "        OPTIMIZERS.add(name, cls)\n"
        "        return cls\n"
        "    return deco\n\n"
        "@register('pool_test_plugin_optimizer')\n"
        "class PluginSGD(torch.optim.SGD):\n"
        "    pass\n"
    )
    assert run_distributed(_still_registered, 2) == [False, False]  # the registry is imported, the name not
    assert run_distributed(_import_a_module_that_registers, 2, str(tmp_path)) == [True, True]
    assert run_distributed(_still_registered, 2) == [True, True]


def test_a_call_that_changes_the_process_for_good_gets_new_processes_after_it():
    pids = run_distributed(_fake_deepspeed_import, 2)
    after = run_distributed(_pid, 2)
    assert set(after).isdisjoint(pids)
    pids = run_distributed(_destroy_world, 2)
    assert set(run_distributed(_pid, 2)).isdisjoint(pids)


def test_a_raising_rank_fails_with_its_traceback_and_the_next_call_runs_on_new_processes():
    pids = run_distributed(_pid, 2)
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on_rank1, 2, timeout=60)
    msg = str(info.value)
    assert msg.startswith("rank 1 raised:\nTraceback") and "KeyError: 'boom-on-rank-1'" in msg
    assert "_raise_on_rank1" in msg
    assert set(run_distributed(_pid, 2)).isdisjoint(pids)


def test_a_hanging_rank_times_out_with_its_rank_named_and_its_processes_end():
    pids = run_distributed(_pid, 2)
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"timed out after 5s; ranks \[0, 1\] never finished"):
        run_distributed(_hang_on_rank0, 2, timeout=5)
    assert time.monotonic() - t0 < 15
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert run_distributed(_pid, 2) != pids


def test_off_runs_every_call_on_fresh_processes(monkeypatch):
    close_worker_pools()  # as when the pool is off for a whole run: no pooled world alive beside the new ones
    monkeypatch.setenv(POOL_ENV, "0")
    assert set(run_distributed(_pid, 2)).isdisjoint(run_distributed(_pid, 2))


def test_a_closed_pool_leaves_no_process():
    pool = WorkerPool(2, "gloo", {}, find_free_port())
    pids = pool.run(_pid, (), {}, timeout=120)
    pool.close()
    assert not pool.alive
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
