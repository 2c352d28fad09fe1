"""Atomic checkpoint directories, RNG state and the plain-data extra state (single process)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from verl_trainer.engine.checkpoint import (
    atomic_checkpoint_dir,
    get_rng_state,
    load_extra_state,
    resolve_checkpoint_dir,
    save_extra_state,
    set_rng_state,
)
from verl_trainer.engine.config import OptimConfig
from verl_trainer.engine.optim import build_lr_scheduler
from verl_trainer.engine.optimizers import build_optimizer


def _write(path, text):
    with atomic_checkpoint_dir(path) as tmp:
        (tmp / "payload.txt").write_text(text)


def test_atomic_dir_commits_and_replaces(tmp_path):
    ckpt = tmp_path / "ckpt"
    _write(ckpt, "one")
    assert (ckpt / "payload.txt").read_text() == "one"
    _write(ckpt, "two")
    assert (ckpt / "payload.txt").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_crash_mid_save_leaves_previous_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    _write(ckpt, "good")
    with pytest.raises(KeyboardInterrupt):
        with atomic_checkpoint_dir(ckpt) as tmp:
            (tmp / "payload.txt").write_text("half")
            raise KeyboardInterrupt  # the process dies mid-save
    assert (ckpt / "payload.txt").read_text() == "good"
    _write(ckpt, "next")  # a stale temporary directory does not block the next save
    assert (ckpt / "payload.txt").read_text() == "next"


def test_crash_between_renames_is_recovered(tmp_path):
    ckpt = tmp_path / "ckpt"
    _write(ckpt, "good")
    ckpt.rename(tmp_path / ".ckpt.old")  # died after moving the old one aside
    assert resolve_checkpoint_dir(ckpt) == tmp_path / ".ckpt.old"
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        resolve_checkpoint_dir(tmp_path / "missing")


def test_rng_and_scheduler_round_trip_through_weights_only(tmp_path):
    cfg = OptimConfig(lr=0.1, lr_scheduler="cosine", warmup_steps=2, total_training_steps=10)
    opt = build_optimizer(torch.nn.Linear(2, 2).parameters(), cfg)
    sched = build_lr_scheduler(opt, cfg)
    for _ in range(3):
        opt.step()
        sched.step()
    torch.manual_seed(5)
    np.random.seed(5)
    random.seed(5)
    save_extra_state(tmp_path, sched, global_step=3, extra={"note": "x"})
    want = (torch.rand(3), np.random.rand(3), random.random())
    torch.rand(7), np.random.rand(7), random.random()
    opt2 = build_optimizer(torch.nn.Linear(2, 2).parameters(), cfg)
    sched2 = build_lr_scheduler(opt2, cfg)
    payload = load_extra_state(tmp_path, sched2)  # torch.load(weights_only=True) inside
    got = (torch.rand(3), np.random.rand(3), random.random())
    torch.testing.assert_close(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert got[2] == want[2]
    assert payload["global_step"] == 3 and payload["extra"] == {"note": "x"}
    assert sched2.last_epoch == sched.last_epoch and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    state = get_rng_state()
    set_rng_state(state)
    torch.load(tmp_path / "extra_state_rank0.pt", weights_only=True)
