"""Loggers by name from an extra: ``logger="mlflow"`` / ``"tensorboard"`` (the Trainer's argument) and verl's
``trainer.logger=['console','mlflow']``. A short SFT fit logs to a local MLflow file store under the run
directory, read back through mlflow's own client, and to TensorBoard event files, read back with
tensorboard's reader; both agree with the CSV logger.

Need the ``mlflow`` / ``tensorboard`` extras; CI installs them in its extras stage (``scripts/ci_ray.sh``
runs the tests marked ``mlflow`` or ``tensorboard``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.trainer.common import SFTData, read_csv_metrics, sft_module, tiny_model
from verl_trainer import Trainer
from verl_trainer.testing.distributed import run_distributed

needs_mlflow = pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="needs the mlflow extra")


def _fit(model_path: str, root: str) -> dict:
    trainer = Trainer(devices=1, max_steps=3, logger=["csv", "mlflow"], enable_progress_bar=False,
                      enable_checkpointing=False, default_root_dir=root, seed=5)
    trainer.fit(sft_module(model_path, micro_batch_size=2, lr=1e-3), SFTData(n=12, batch_size=4))
    mlflow_logger = trainer.loggers[1]
    return {"run_id": mlflow_logger.run_id, "type": type(mlflow_logger).__name__}


@pytest.mark.mlflow
@needs_mlflow
def test_a_fit_logs_to_a_local_mlflow_store_read_back_with_mlflow(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root = tmp_path / "run"
    out = run_distributed(_fit, 1, tiny_model(tmp_path / "model"), str(root), timeout=300,
                          env={"WANDB_MODE": "offline", "MLFLOW_TRACKING_URI": ""})[0]
    assert out["type"] == "MLFlowLogger" and (root / "mlruns").is_dir()  # a file store, no server
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow.MlflowClient(f"file:{root / 'mlruns'}")
    run = client.get_run(out["run_id"])
    assert client.get_experiment(run.info.experiment_id).name == "verl-trainer"
    history = client.get_metric_history(out["run_id"], "sft/loss")
    csv = read_csv_metrics(root / "lightning_logs" / "version_0")
    assert sorted(m.step for m in history) == sorted(csv) == [1, 2, 3]
    for m in history:  # the same numbers the CSV logger wrote
        assert m.value == pytest.approx(csv[m.step]["sft/loss"], rel=1e-6)
    assert run.data.params["model_path"] == str(tmp_path / "model")  # the hyperparameters


@pytest.mark.mlflow
@needs_mlflow
def test_verl_logger_list_with_mlflow_names_the_experiment_and_run(tmp_path, monkeypatch):
    from lightning.pytorch.loggers import MLFlowLogger

    from verl_trainer.configs.loading import load_config
    from verl_trainer.configs.recipes import GRPORecipeConfig
    from verl_trainer.configs.verl_keys import translate_overrides

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    verl = ["trainer.logger=['console','mlflow']", "trainer.project_name=my_project",
            "trainer.experiment_name=exp1", f"trainer.default_root_dir={tmp_path}"]
    overrides, _ = translate_overrides(GRPORecipeConfig, verl)
    config = load_config(GRPORecipeConfig, None, overrides).trainer
    assert config.unused_settings() == []  # the names are used: mlflow's experiment and run
    logger = config.build(enable_checkpointing=False).logging.spec[0]
    assert isinstance(logger, MLFlowLogger) and logger._experiment_name == "my_project"
    assert logger._run_name == "exp1"
    assert logger._tracking_uri == f"file:{Path(tmp_path).resolve() / 'mlruns'}"


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
