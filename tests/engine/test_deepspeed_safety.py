"""DeepSpeed's own checkpoint files with a booby trap: loading fails naming the file and runs nothing.

DeepSpeed reads its model and optimizer files with ``torch.load(weights_only=False)``; the engine swaps in
a checkpoint engine that reads them with ``weights_only=True``. A ZeRO-2 engine (1 gloo rank, CPU) saves
a checkpoint; copies with a trap planted in one DeepSpeed file (and the manifest rewritten to match, as
an attacker would) are loaded into a fresh engine.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from tests.booby_trap import Trap
from tests.engine.common import build_engine, nll_loss, random_batch, tiny_model
from verl_trainer.engine import OptimConfig
from verl_trainer.testing import run_distributed

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")

FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt")


def _trap_run(model_path: str, root: str) -> dict:
    import torch

    from verl_trainer.utils.manifest import write_manifest

    root_dir = Path(root)
    engine = build_engine("deepspeed_stage_2", "language_model", model_path, OptimConfig(lr=1e-3),
                          micro_batch_size_per_gpu=2)
    with engine.train_mode():
        engine.train_batch(random_batch(4), nll_loss)
    engine.save_checkpoint(str(root_dir / "good"), global_step=1)
    out: dict = {}
    for name in FILES:
        copy, marker = root_dir / f"trap_{name}", root_dir / f"ran_{name}"
        shutil.copytree(root_dir / "good", copy)
        file = copy / "deepspeed" / "state" / name
        state = torch.load(file, weights_only=False)  # our own file, written above
        state["planted"] = Trap(marker)
        torch.save(state, file)
        write_manifest(copy)
        try:
            engine.load_checkpoint(str(copy))
            error = None
        except Exception as exc:
            error = (type(exc).__name__, str(exc))
        out[name] = (error, marker.exists())
    out["good"] = engine.load_checkpoint(str(root_dir / "good"))["global_step"]
    return out


@pytest.fixture(scope="module")
def outcome(tmp_path_factory) -> dict:
    model_path = tiny_model(str(tmp_path_factory.mktemp("ds_safety") / "model"))
    root = tmp_path_factory.mktemp("ds_ckpt")
    return run_distributed(_trap_run, 1, model_path, str(root), timeout=300, env={"DS_ACCELERATOR": "cpu"})[0]


@pytest.mark.parametrize("name", FILES)
def test_deepspeed_file_with_a_trap_runs_nothing_and_is_named(outcome, name):
    error, ran = outcome[name]
    assert not ran, f"the trap in {name} ran"
    assert error is not None and error[0] == "UnsafeCheckpointError", error
    assert name in error[1] and "refusing to load" in error[1], error[1]


def test_untouched_deepspeed_checkpoint_loads(outcome):
    assert outcome["good"] == 1
