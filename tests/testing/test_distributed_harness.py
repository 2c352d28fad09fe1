import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from verl_trainer.testing import DistributedTestError, run_distributed
from verl_trainer.testing.ranks import POOL_ENV


def _all_reduce_rank():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), os.getpid()


def _raise_on_rank1():
    if dist.get_rank() == 1:
        raise KeyError("boom-on-rank-1")
    dist.barrier()  # rank 0 would hang here forever without the harness
    return "unreachable"


def _hang():
    time.sleep(3600)


def _die_on_rank0():
    if dist.get_rank() == 0:
        os._exit(3)
    dist.barrier()


def _abort_on_rank0():
    if dist.get_rank() == 0:
        os.abort()  # as a native crash does (glibc's heap checks abort)
    dist.barrier()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_results_come_back_per_rank(world_size):
    out = run_distributed(_all_reduce_rank, world_size)
    assert [r[0] for r in out] == list(range(world_size))
    assert all(r[1] == world_size for r in out)
    assert all(r[2] == world_size * (world_size + 1) / 2 for r in out)
    assert len({r[3] for r in out}) == world_size  # real, distinct processes


def test_exception_on_one_rank_fails_with_its_traceback():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on_rank1, 2, timeout=60)
    msg = str(info.value)
    assert "rank 1 raised" in msg and "boom-on-rank-1" in msg and "KeyError" in msg


def test_hang_times_out_and_leaves_no_orphans():
    import multiprocessing

    before = {p.pid for p in multiprocessing.active_children()}
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError, match="timed out"):
        run_distributed(_hang, 2, timeout=5)
    assert time.monotonic() - t0 < 30
    after = {p.pid for p in multiprocessing.active_children()}
    assert after <= before


def test_dead_rank_is_reported():
    with pytest.raises(DistributedTestError, match="rank 0 exited with code 3") as info:
        run_distributed(_die_on_rank0, 2, timeout=60)
    assert info.value.crash_signal is None  # an exit, not a crash


@pytest.mark.parametrize("pooled", ["1", "0"])
def test_a_rank_killed_by_a_signal_names_it_and_prints_its_stack(pooled, monkeypatch, capfd):
    monkeypatch.setenv(POOL_ENV, pooled)
    with pytest.raises(DistributedTestError, match="rank 0 exited with code -6") as info:
        run_distributed(_abort_on_rank0, 2, timeout=60)
    assert info.value.crash_signal == signal.SIGABRT
    err = capfd.readouterr().err
    assert "Fatal Python error: Aborted" in err and "in _abort_on_rank0" in err
