import atexit
import gc
import os
from contextlib import ExitStack
from pathlib import Path

from verl_trainer.testing.gc_freeze import imports_without_gc
from verl_trainer.utils.threads import apply_thread_env_defaults

# Collection imports every test module and, through them, torch, transformers and the project: with the
# cyclic collector off until collection ends, then those objects frozen (verl_trainer.testing.gc_freeze).
_COLLECTION_GC = ExitStack()
_COLLECTION_GC.enter_context(imports_without_gc())

# Before torch loads libgomp: idle OpenMP threads sleep instead of spinning, in this process and every rank
# it spawns (the commands' default; the suite runs several processes per core).
apply_thread_env_defaults()

import pytest  # noqa: E402
import torch  # noqa: E402

import verl_trainer.testing  # noqa: E402
from verl_trainer.testing import use_worker_pool  # noqa: E402

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One CPU attention path per layout in every test process and every rank it spawns: runs that a test
# compares must not differ by what a timing chose (tests/models/test_attention_autotune.py turns it on).
os.environ.setdefault("VERL_TRAINER_ATTENTION_AUTOTUNE", "0")
os.environ.setdefault("VERL_TRAINER_ATTENTION_AUTOTUNE_CACHE", "0")
# Every Python process a test starts (recipes, scripts, ranks) skips the cyclic collection of its shutdown
# (verl_trainer/testing/exit_freeze/sitecustomize.py); this process too, as the session ends.
_EXIT_FREEZE = str(Path(verl_trainer.testing.__file__).parent / "exit_freeze")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_EXIT_FREEZE, os.environ.get("PYTHONPATH")) if p)
atexit.register(gc.freeze)

# What a Trainer or engine started in the pytest process leaves behind: every later test and every
# subprocess it starts would inherit them (a recipe launched by a later test rendezvoused on a port this
# process still held: EADDRINUSE).
_LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                "NODE_RANK", "VERL_TRAINER_LAUNCHER_PID")


@pytest.fixture(autouse=True)
def _deterministic_seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _no_process_group_left_behind(request):
    """Fail a test that leaves a process group or launch variables in the pytest process, and undo them.

    A test that runs a Trainer or an engine does it on spawned ranks
    (``verl_trainer.testing.run_distributed``); a test file that CI runs in its own process and that
    makes a process group on purpose is marked ``own_process_group``.
    """
    before = {name: os.environ.get(name) for name in _LAUNCH_VARS}
    yield
    if request.node.get_closest_marker("own_process_group"):
        return
    import torch.distributed as dist

    left = []
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        left.append("an initialised default process group")
    changed = sorted(name for name, value in before.items() if os.environ.get(name) != value)
    for name in changed:
        if before[name] is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before[name]
    if changed:
        left.append("environment variables " + ", ".join(changed))
    if left:
        pytest.fail(f"this test left {' and '.join(left)} in the pytest process (undone now); run Trainers "
                    "and engines on spawned ranks with verl_trainer.testing.run_distributed", pytrace=False)


def pytest_configure(config: pytest.Config) -> None:
    # Distributed tests run on gloo ranks kept alive between tests (verl_trainer.testing.worker_pool):
    # starting fresh ranks for every test cost more than most of those tests ran.
    use_worker_pool(True)


def pytest_collection_finish(session: pytest.Session) -> None:
    _COLLECTION_GC.close()  # the collector back on; what collection imported is frozen


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    use_worker_pool(False)
