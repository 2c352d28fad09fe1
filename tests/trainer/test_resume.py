"""Exact resume: a 6-step fit equals a fit killed with SIGKILL after 3 steps and resumed with
``ckpt_path="last"`` for 3 more — the same logged metrics and the same final parameters, bitwise, at 2
ranks, for fsdp2 and deepspeed. A checkpoint interrupted mid-write is never chosen as "last"."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.trainer.common import assert_all_gone, read_csv_metrics, run_script, tiny_model
from verl_trainer.utils.dir_lock import LOCK_FILE


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return tiny_model(tmp_path_factory.mktemp("model"))


@pytest.mark.parametrize(
    ("strategy", "kill_mode"),
    [
        # killed in the middle of writing step 4's checkpoint: "last" must be step 3
        ("fsdp2", "midwrite"),
        # killed after step 3's checkpoint, as step 4 starts (slow: 57 s; DeepSpeed resume is also
        # covered by tests/engine checkpoint round-trips in the default slice)
        pytest.param("deepspeed", "start", marks=[pytest.mark.slow, pytest.mark.skipif(
            importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")]),
    ],
)
def test_killed_and_resumed_fit_equals_uninterrupted_fit(model_path, tmp_path, strategy, kill_mode):
    common = ["--model", model_path, "--strategy", strategy, "--devices", "2", "--max-steps", "6",
              "--every-n", "1", "--logger", "csv"]
    full, cut = tmp_path / "full", tmp_path / "cut"

    rc, out, _ = run_script("--root", str(full), *common, "--params-out", str(tmp_path / "full.pt"))
    assert rc == 0, out

    kill_step = 4 if kill_mode == "midwrite" else 3
    rc, out, _ = run_script("--root", str(cut), *common, "--kill-at-step", str(kill_step),
                            "--kill-mode", kill_mode)
    assert rc == -9, out  # SIGKILLed, all ranks
    assert_all_gone(cut)
    names = sorted(p.name for p in (cut / "checkpoints").iterdir())
    assert LOCK_FILE in names, names  # the killed run's lock file stays behind (the kernel freed the lock)
    names.remove(LOCK_FILE)
    if kill_mode == "midwrite":
        assert names[0].startswith(".step_000004.tmp-") and names[1:] == ["step_000002", "step_000003"], names
    else:
        assert names == ["step_000002", "step_000003"], names

    rc, out, _ = run_script("--root", str(cut), *common, "--ckpt-path", "last",
                            "--params-out", str(tmp_path / "cut.pt"))
    assert rc == 0, out
    assert "step 4/6" in out and "step 3/6" not in out  # resumed after step 3
    assert "took over a stale lock left by pid" in out and "no longer running" in out, out

    want, got = read_csv_metrics(full), read_csv_metrics(cut)
    assert sorted(want) == sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in want:
        assert got[step] == want[step], (step, got[step], want[step])  # exact float equality
    want_params, got_params = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "cut.pt")
    assert sorted(want_params) == sorted(got_params)
    for name, value in want_params.items():
        assert torch.equal(got_params[name], value), name
