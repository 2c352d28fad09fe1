"""Launching from a plain ``python script.py`` (real subprocesses), joining torchrun, and failures that end
every rank with the failing rank's error instead of hanging."""

from __future__ import annotations

import pytest

from tests.trainer.common import assert_all_gone, read_csv_metrics, run_script, tiny_model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return tiny_model(tmp_path_factory.mktemp("model"))


def test_plain_python_two_processes_progress_wandb_csv(model_path, tmp_path):
    rc, out, _ = run_script("--root", str(tmp_path), "--model", model_path, "--devices", "2",
                            "--max-steps", "2", "--logger", "csv,wandb")
    assert rc == 0, out
    assert "fit done: world_size=2 global_step=2" in out
    assert out.count("fit done") == 1  # rank 0 only
    assert "step 2/2" in out and "loss=" in out  # the progress bar
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, sorted(p.name for p in tmp_path.rglob("*"))
    metrics = read_csv_metrics(tmp_path / "lightning_logs")
    assert sorted(metrics) == [1, 2] and "sft/loss" in metrics[2]
    assert (tmp_path / "lightning_logs" / "version_0" / "hparams.yaml").is_file()
    assert (tmp_path / "checkpoints" / "step_000002" / "trainer_state.pt").is_file()
    assert_all_gone(tmp_path)


def test_torchrun_joins_the_existing_world(model_path, tmp_path):
    rc, out, _ = run_script("--root", str(tmp_path), "--model", model_path, "--devices", "2",
                            "--max-steps", "1", "--logger", "", torchrun=True)
    assert rc == 0, out
    assert out.count("fit done: world_size=2 global_step=1") == 1
    assert sorted(p.name for p in (tmp_path / "pids").iterdir()) == ["rank0.pid", "rank1.pid"]


@pytest.mark.parametrize(
    ("rank", "mode", "expected"),
    [
        (1, "raise", "injected failure on rank 1 at step 2"),
        pytest.param(0, "raise", "injected failure on rank 0 at step 2", marks=pytest.mark.slow),
        pytest.param(1, "sigkill", "rank 1 was killed by signal 9", marks=pytest.mark.slow),
    ],
)
def test_a_crash_on_one_rank_ends_every_rank(model_path, tmp_path, rank, mode, expected):
    rc, out, seconds = run_script("--root", str(tmp_path), "--model", model_path, "--devices", "2",
                                  "--max-steps", "4", "--logger", "", "--fail-rank", str(rank),
                                  "--fail-step", "2", "--fail-mode", mode, timeout=240)
    assert rc != 0, out
    other = 1 - rank
    # the other rank ends with a RankFailedError that carries the failing rank's error
    assert f"[rank{other}]: verl_trainer.training.failure.RankFailedError: rank {rank} failed" in out, out
    assert expected in out.split("RankFailedError", 1)[1], out
    # the traceback is printed once, by the failing rank; the other rank prints one line about it
    assert out.count(expected) == (2 if mode == "raise" else 1), out
    assert "frame #" not in out, out  # no C++ stack from gloo/TCPStore
    assert "fit done" not in out
    assert_all_gone(tmp_path)


@pytest.mark.slow
def test_a_stalled_rank_ends_the_run_after_the_collective_timeout(model_path, tmp_path):
    rc, out, seconds = run_script("--root", str(tmp_path), "--model", model_path, "--devices", "2",
                                  "--max-steps", "4", "--logger", "", "--fail-rank", "1", "--fail-step", "2",
                                  "--fail-mode", "stall", "--collective-timeout", "5", timeout=240)
    assert rc != 0, out
    assert seconds < 100, f"the run took {seconds:.0f} s; rank 1 stalls for 120 s"
    assert "collective_timeout" in out, out
    assert "fit done" not in out
    assert_all_gone(tmp_path)
