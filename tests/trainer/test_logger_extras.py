"""Loggers by name from an extra: ``logger="mlflow"`` / ``"tensorboard"`` (the Trainer's argument) and verl's
``trainer.logger=['console','mlflow']``. A short SFT fit logs to a local MLflow SQLite store under the run
directory, read back by another process through mlflow's own client with no extra settings, and to
TensorBoard event files, read back with tensorboard's reader; both agree with the CSV logger.

Need the ``mlflow`` / ``tensorboard`` extras; CI installs them in its extras stage (``scripts/ci_ray.sh``
runs the tests marked ``mlflow`` or ``tensorboard``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.common import SFTData, read_csv_metrics, sft_module, tiny_model
from verl_trainer import Trainer
from verl_trainer.testing.ranks import run_distributed

ROOT = Path(__file__).resolve().parents[2]

needs_mlflow = pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="needs the mlflow extra")


def _fit(model_path: str, root: str) -> dict:
    trainer = Trainer(devices=1, max_steps=3, logger=["csv", "mlflow"], enable_progress_bar=False,
                      enable_checkpointing=False, default_root_dir=root, seed=5)
    trainer.fit(sft_module(model_path, micro_batch_size=2, lr=1e-3), SFTData(n=12, batch_size=4))
    mlflow_logger = trainer.loggers[1]
    return {"run_id": mlflow_logger.run_id, "type": type(mlflow_logger).__name__}


READ_BACK = """
import json, sys
import mlflow
client = mlflow.MlflowClient(sys.argv[1])
experiment = client.get_experiment_by_name("verl-trainer")
(run,) = client.search_runs([experiment.experiment_id])
history = client.get_metric_history(run.info.run_id, "sft/loss")
print(json.dumps({"run_id": run.info.run_id, "loss": {m.step: m.value for m in history},
                  "params": run.data.params, "metrics": run.data.metrics}))
"""
"""A second process reading the one run of the experiment ``verl-trainer`` with mlflow's client, with no
MLFLOW_* variable set."""


def read_back(tracking_uri: str, cwd: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    proc = subprocess.run([sys.executable, "-c", READ_BACK, tracking_uri], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.mlflow
@needs_mlflow
def test_a_fit_logs_to_a_local_mlflow_store_another_process_reads_back(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root = tmp_path / "run"
    out = run_distributed(_fit, 1, tiny_model(tmp_path / "model"), str(root), timeout=300,
                          env={"WANDB_MODE": "offline", "MLFLOW_TRACKING_URI": ""})[0]
    assert out["type"] == "MLFlowLogger" and (root / "mlflow.db").is_file()  # a SQLite file, no server
    assert not (root / "mlruns").exists() and not (Path.cwd() / "mlruns").exists()
    # a second process, as `mlflow ui` or a notebook would be: mlflow's own client, no extra settings
    back = read_back(f"sqlite:///{root / 'mlflow.db'}", tmp_path)
    assert back["run_id"] == out["run_id"]
    csv = read_csv_metrics(root / "lightning_logs" / "version_0")
    loss = {int(step): value for step, value in back["loss"].items()}
    assert sorted(loss) == sorted(csv) == [1, 2, 3]
    for step, value in loss.items():  # the same numbers the CSV logger wrote
        assert value == pytest.approx(csv[step]["sft/loss"], rel=1e-6)
    assert back["params"]["model_path"] == str(tmp_path / "model")  # the hyperparameters


@pytest.mark.mlflow
@needs_mlflow
def test_a_recipe_run_logs_to_mlflow_and_its_report_says_how_to_open_it(tmp_path):
    """``python recipes/sft.py trainer.logger=[csv,mlflow]``: the run config and the module's settings are
    logged once (MLflow refuses a parameter that changes value), validation included."""
    from tests.recipes.test_recipes import make_recipe_assets

    assets = make_recipe_assets(tmp_path / "assets")
    root = tmp_path / "run"
    args = [sys.executable, str(ROOT / "recipes" / "sft.py"), "trainer.max_steps=2",
            "trainer.val_check_interval=2", "trainer.logger=[csv,mlflow]", f"trainer.default_root_dir={root}",
            "trainer.export_hf=false", "trainer.enable_checkpointing=false", f"model.path={assets / 'model'}",
            f"task.dir={assets / 'data'}", "task.write_if_missing=false", "data.train_batch_size=4"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    proc = subprocess.run(args, cwd=tmp_path, env={**env, "WANDB_MODE": "offline"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    uri = f"sqlite:///{root / 'mlflow.db'}"
    assert f"MLflow:    {uri}  (`mlflow ui --backend-store-uri {uri}` shows it)" in proc.stdout, proc.stdout
    back = read_back(uri, tmp_path)
    assert sorted(int(step) for step in back["loss"]) == [1, 2] and "val/loss" in back["metrics"]
    assert back["params"]["algorithm/model_path"] == str(assets / "model")  # the module's, not the YAML's ""
    assert back["params"]["trainer/max_steps"] == "2"


@pytest.mark.mlflow
@needs_mlflow
def test_the_sqlite_store_without_its_database_packages_names_the_extra(monkeypatch):
    from verl_trainer.training import loggers

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(loggers, "SQL_STORE_PACKAGES", ("sqlalchemy", "no_such_package_for_the_test"))
    missing = r"needs no_such_package_for_the_test .*pip install verl-trainer\[mlflow\]"
    with pytest.raises(ValueError, match=missing):
        loggers.validate_logger_spec("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")  # a server: no SQL packages needed
    loggers.validate_logger_spec("mlflow")


@pytest.mark.mlflow
@needs_mlflow
def test_verl_logger_list_with_mlflow_names_the_experiment_and_run(tmp_path, monkeypatch):
    from lightning.pytorch.loggers import MLFlowLogger

    from verl_trainer.recipe_config.loading import load_config
    from verl_trainer.recipe_config.recipes import GRPORecipeConfig
    from verl_trainer.recipe_config.verl_keys import translate_overrides

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    verl = ["trainer.logger=['console','mlflow']", "trainer.project_name=my_project",
            "trainer.experiment_name=exp1", f"trainer.default_root_dir={tmp_path}"]
    overrides, _ = translate_overrides(GRPORecipeConfig, verl)
    config = load_config(GRPORecipeConfig, None, overrides).trainer
    assert config.unused_settings() == []  # the names are used: mlflow's experiment and run
    logger = config.build(enable_checkpointing=False).logging.spec[0]
    assert isinstance(logger, MLFlowLogger) and logger._experiment_name == "my_project"
    assert logger._run_name == "exp1"
    assert logger._tracking_uri == f"sqlite:///{Path(tmp_path).resolve() / 'mlflow.db'}"


def _fit_tensorboard(model_path: str, root: str) -> None:
    trainer = Trainer(devices=1, max_steps=3, logger=["csv", "tensorboard"], enable_progress_bar=False,
                      enable_checkpointing=False, default_root_dir=root, seed=5)
    trainer.fit(sft_module(model_path, micro_batch_size=2, lr=1e-3), SFTData(n=12, batch_size=4))


@pytest.mark.tensorboard
@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="needs the tensorboard extra")
def test_a_fit_logs_tensorboard_events_read_back_with_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = tmp_path / "run"
    run_distributed(_fit_tensorboard, 1, tiny_model(tmp_path / "model"), str(root), timeout=300,
                    env={"WANDB_MODE": "offline"})
    csv = read_csv_metrics(root / "lightning_logs" / "version_0")
    events = sorted(root.rglob("events.out.tfevents.*"))
    assert len(events) == 1, events
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    scalars = acc.Scalars("sft/loss")
    assert sorted(s.step for s in scalars) == sorted(csv) == [1, 2, 3]
    for s in scalars:
        assert s.value == pytest.approx(csv[s.step]["sft/loss"], rel=1e-6)
