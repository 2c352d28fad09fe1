"""Pruning and ``ckpt_path="last"`` per run (files only, no training)."""

from __future__ import annotations

import json

import pytest

from verl_trainer.engine.checkpoint_dirs import (
    STATE_FILE,
    claim_checkpoint_dir,
    find_last_checkpoint,
    prune_checkpoints,
)
from verl_trainer.utils.fs import mark_owned


def _checkpoint(root, step: int, run_id: str | None, owned: bool = True):
    path = root / f"step_{step:06d}"
    path.mkdir(parents=True)
    if owned:
        mark_owned(path, "checkpoint", run_id=run_id)
    (path / STATE_FILE).write_bytes(b"x")
    (path / "meta.json").write_text(json.dumps({"global_step": step, "run_id": run_id}))
    return path


def test_prune_deletes_only_the_current_runs_checkpoints(tmp_path):
    for step in (5, 6, 7):
        _checkpoint(tmp_path, step, "older")  # an older, longer run
    for step in (1, 2, 3):
        _checkpoint(tmp_path, step, "new")
    removed = prune_checkpoints(tmp_path, keep=1, current_step=3, run_id="new")
    assert sorted(p.name for p in removed) == ["step_000001", "step_000002"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003", "step_000005", "step_000006",
                                                          "step_000007"]


def test_prune_never_deletes_a_directory_without_the_marker(tmp_path):
    _checkpoint(tmp_path, 1, "run", owned=False)
    _checkpoint(tmp_path, 2, "run")
    with pytest.warns(UserWarning, match="not pruning .*step_000001.*did not write it"):
        prune_checkpoints(tmp_path, keep=1, current_step=2, run_id="run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001", "step_000002"]


def test_last_is_refused_when_several_runs_share_a_directory(tmp_path):
    _checkpoint(tmp_path, 4, "one")
    _checkpoint(tmp_path, 2, "two")
    with pytest.raises(ValueError, match=r"ambiguous.*run two \(step 2\); run one \(step 4\).*=<dir>"):
        find_last_checkpoint(tmp_path)


def test_claim_gives_a_fresh_run_an_id_and_keeps_a_resumed_runs_id(tmp_path):
    run_id, cleaned = claim_checkpoint_dir(tmp_path / "new", None)
    assert len(run_id) == 12 and cleaned == []
    _checkpoint(tmp_path, 3, "abc")
    assert claim_checkpoint_dir(tmp_path, "abc", resumed=True)[0] == "abc"
    with pytest.raises(FileExistsError, match=r"run abc \(step 3\)\); run xyz would mix"):
        claim_checkpoint_dir(tmp_path, "xyz", resumed=True)
    with pytest.raises(FileExistsError, match=r"run abc \(step 3\)\); a new run would mix"):
        claim_checkpoint_dir(tmp_path, None)


def test_a_run_resumed_from_a_checkpoint_without_a_run_id_owns_the_ones_without(tmp_path):
    _checkpoint(tmp_path, 2, None)
    assert claim_checkpoint_dir(tmp_path, None, resumed=True)[0] is None
    _checkpoint(tmp_path, 4, "abc")
    with pytest.raises(FileExistsError, match=r"run abc \(step 4\)"):
        claim_checkpoint_dir(tmp_path, None, resumed=True)


def test_prune_keeps_a_checkpoint_holding_a_users_file(tmp_path):
    from verl_trainer.utils.fs import record_files

    for step in (1, 2):
        record_files(_checkpoint(tmp_path, step, "run"))
    (tmp_path / "step_000001" / "my_eval.json").write_text("mine")  # added by a user after the save
    kept = r"not pruning: .*step_000001.*files it did not write \(my_eval.json\)"
    with pytest.warns(UserWarning, match=kept):
        removed = prune_checkpoints(tmp_path, keep=1, current_step=2, run_id="run")
    assert removed == [] and (tmp_path / "step_000001" / "my_eval.json").read_text() == "mine"
