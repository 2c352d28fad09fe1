"""Resuming from a tampered checkpoint: booby-trapped files run nothing, damaged files are refused.

One 1-rank run (fsdp2, CPU) writes a real checkpoint, then resumes ``fit(ckpt_path=<copy>)`` from copies
of it, each changed in one way:

* booby traps (an object whose unpickling would create a marker file) planted in the DCP ``.metadata``,
  ``trainer_state.pt``, ``rng_rank0.pt`` and the engine's scheduler/RNG file, with the manifests
  rewritten to match, as an attacker would: the load must fail naming the file, and no marker may exist;
* damage without a matching manifest (flipped middle bytes of the weights, a truncated RNG file, a missing
  scheduler file): the integrity check must refuse it, naming the file;
* an untouched copy: resumes (so the failures above come from the changes, not from the copying).
"""

from __future__ import annotations

import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.booby_trap import Trap
from tests.trainer.common import SFTData, sft_module, tiny_model
from verl_trainer import Trainer
from verl_trainer.callbacks import ModelCheckpoint
from verl_trainer.testing.ranks import run_distributed

ENGINE = Path("engines") / "actor"


def _plant_in_torch_file(file: Path, marker: Path) -> None:
    import torch

    from verl_trainer.utils.safe_load import safe_torch_load

    state = safe_torch_load(file)  # our own file, read safely
    state["planted"] = Trap(marker)
    torch.save(state, file)


def _plant_in_metadata(file: Path, marker: Path) -> None:
    with open(file, "rb") as f:
        metadata = pickle.load(f)  # our own file, written by the run above
    metadata.planner_data = Trap(marker)
    file.write_bytes(pickle.dumps(metadata))


def _rewrite_manifests(ckpt: Path) -> None:
    from verl_trainer.utils.manifest import write_manifest

    write_manifest(ckpt / ENGINE)
    write_manifest(ckpt)


def _flip_middle_bytes(file: Path) -> None:
    data = bytearray(file.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 8):
        data[i] ^= 0xFF
    file.write_bytes(bytes(data))


def _truncate(file: Path, size: int) -> None:
    file.write_bytes(file.read_bytes()[:size])


TRAPS: dict[str, Callable[[Path, Path], None]] = {
    ".metadata": lambda ckpt, m: _plant_in_metadata(ckpt / ENGINE / "dcp" / ".metadata", m),
    "trainer_state.pt": lambda ckpt, m: _plant_in_torch_file(ckpt / "trainer_state.pt", m),
    "rng_rank0.pt": lambda ckpt, m: _plant_in_torch_file(ckpt / "rng_rank0.pt", m),
    "extra_state_rank0.pt": lambda ckpt, m: _plant_in_torch_file(ckpt / ENGINE / "extra_state_rank0.pt", m),
}
DAMAGE: dict[str, Callable[[Path], None]] = {
    "__0_0.distcp": lambda ckpt: _flip_middle_bytes(ckpt / ENGINE / "dcp" / "__0_0.distcp"),
    "rng_rank0.pt": lambda ckpt: _truncate(ckpt / "rng_rank0.pt", 100),
    "extra_state_rank0.pt": lambda ckpt: (ckpt / ENGINE / "extra_state_rank0.pt").unlink(),
}


def _resume(model_path: str, ckpt: Path, root: Path) -> tuple[str, str] | None:
    trainer = Trainer(strategy="fsdp2", devices=1, max_steps=3, default_root_dir=root, logger=False,
                      enable_progress_bar=False, enable_checkpointing=False)
    try:
        trainer.fit(sft_module(model_path), SFTData(n=16, batch_size=4), ckpt_path=ckpt)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def _tamper_and_resume(model_path: str, root: str) -> dict:
    """Runs in a fresh 1-rank process."""
    root = Path(root)
    Trainer(strategy="fsdp2", devices=1, max_steps=2, default_root_dir=root / "run", logger=False,
            enable_progress_bar=False, callbacks=[ModelCheckpoint(every_n_train_steps=2)]
            ).fit(sft_module(model_path), SFTData(n=16, batch_size=4))
    good = root / "run" / "checkpoints" / "step_000002"
    out: dict = {"traps": {}, "damage": {}}
    for name, plant in TRAPS.items():
        copy, marker = root / f"trap_{name}", root / f"ran_{name}"
        shutil.copytree(good, copy)
        plant(copy, marker)
        _rewrite_manifests(copy)
        out["traps"][name] = (_resume(model_path, copy, root / "resume"), marker.exists())
    for name, damage in DAMAGE.items():
        copy = root / f"damaged_{name}"
        shutil.copytree(good, copy)
        damage(copy)
        out["damage"][name] = _resume(model_path, copy, root / "resume")
    shutil.copytree(good, root / "untouched")
    out["untouched"] = _resume(model_path, root / "untouched", root / "resume")
    return out


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def outcome(model_path, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tampered")
    return run_distributed(_tamper_and_resume, 1, model_path, str(root), timeout=400,
                           env={"WANDB_MODE": "offline"})[0]


@pytest.mark.parametrize("name", sorted(TRAPS))
def test_booby_trapped_file_runs_nothing_and_is_named(outcome, name):
    error, ran = outcome["traps"][name]
    assert not ran, f"the trap in {name} ran"
    assert error is not None and error[0] == "UnsafeCheckpointError", error
    assert name in error[1] and "refusing to load" in error[1], error[1]


@pytest.mark.parametrize(("name", "what"), [("__0_0.distcp", "sha256 differs"),
                                            ("rng_rank0.pt", "100 bytes, the manifest records"),
                                            ("extra_state_rank0.pt", "missing")])
def test_damaged_file_is_refused_by_the_manifest_and_named(outcome, name, what):
    error = outcome["damage"][name]
    assert error is not None and error[0] == "CorruptCheckpointError", error
    assert f"{name}: {what}" in error[1], error[1]


def test_untouched_copy_resumes(outcome):
    assert outcome["untouched"] is None
