"""Booby-trapped files fail to load, naming the file, and run nothing (single process, DCP on CPU).

Each trap is an object whose ``__reduce__`` creates a marker file when unpickled. Every test also shows
the trap is live: the loader the project replaced (plain ``pickle`` / ``torch.load(weights_only=False)``
/ stock ``dcp.load``) does create the marker.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from tests.booby_trap import Trap
from verl_trainer.engine.safe_dcp import safe_dcp_load
from verl_trainer.utils.safe_load import UnsafeCheckpointError, safe_torch_load


def _model_and_optim() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    return model, optim


def _dcp_save(path: Path, state: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(path))


def _dcp_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optimizer": optim_sd}


def test_torch_file_with_a_trap_is_refused_and_runs_nothing(tmp_path):
    marker, file = tmp_path / "ran", tmp_path / "trainer_state.pt"
    torch.save({"global_step": 3, "payload": Trap(marker)}, file)
    with pytest.raises(UnsafeCheckpointError, match="trainer_state.pt") as err:
        safe_torch_load(file)
    assert not marker.exists()
    assert "not written by verl-trainer" in str(err.value) and "io.open" in str(err.value)
    torch.load(file, weights_only=False)  # the trap is live
    assert marker.exists()


def test_truncated_or_missing_torch_file_names_the_file(tmp_path):
    file = tmp_path / "rng_rank0.pt"
    torch.save({"rng": torch.get_rng_state()}, file)
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(UnsafeCheckpointError, match="rng_rank0.pt.*not a readable torch file"):
        safe_torch_load(file)
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        safe_torch_load(tmp_path / "missing.pt")


def test_dcp_round_trip_through_the_safe_reader(tmp_path):
    model, optim = _model_and_optim()
    _dcp_save(tmp_path / "dcp", _dcp_state(model, optim))
    other, other_optim = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)), None
    other_optim = torch.optim.AdamW(other.parameters(), lr=5.0)
    other(torch.randn(3, 4)).sum().backward()
    other_optim.step()
    state = _dcp_state(other, other_optim)
    safe_dcp_load(state, tmp_path / "dcp")
    want = _dcp_state(model, optim)
    for key, value in want["model"].items():
        assert torch.equal(state["model"][key], value), key
    assert state["optimizer"]["param_groups"][0]["lr"] == 1e-3  # a non-tensor entry (weights_only bytes)


def test_dcp_metadata_with_a_trap_is_refused_and_runs_nothing(tmp_path):
    model, optim = _model_and_optim()
    _dcp_save(tmp_path / "dcp", _dcp_state(model, optim))
    meta_file, marker = tmp_path / "dcp" / ".metadata", tmp_path / "ran"
    with open(meta_file, "rb") as f:
        metadata = pickle.load(f)  # our own file, written above
    metadata.planner_data = Trap(marker)  # an otherwise valid metadata file
    meta_file.write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata.*not on the allow-list") as err:
        safe_dcp_load(_dcp_state(model, optim), tmp_path / "dcp")
    assert not marker.exists()
    assert "refusing to load" in str(err.value)
    dcp.load(_dcp_state(model, optim), checkpoint_id=str(tmp_path / "dcp"))  # the stock reader runs it
    assert marker.exists()


def test_dcp_non_tensor_entry_with_a_trap_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    _dcp_save(tmp_path / "dcp", {"w": torch.ones(2), "extra": Trap(marker)})
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpointError, match=r"entry 'extra'") as err:
        safe_dcp_load({"w": torch.zeros(2), "extra": None}, tmp_path / "dcp")
    assert not marker.exists()
    assert "refusing to load" in str(err.value) and str(tmp_path / "dcp") in str(err.value)
    dcp.load({"w": torch.zeros(2), "extra": None}, checkpoint_id=str(tmp_path / "dcp"))  # stock planner
    assert marker.exists()
