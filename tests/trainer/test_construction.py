"""Invalid Trainer arguments and combinations fail at construction with a clear message."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from lightning.fabric.plugins.environments import (
    LightningEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)

from verl_trainer import Trainer
from verl_trainer.callbacks import (
    Callback,
    LearningRateMonitor,
    MetricReduction,
    ModelCheckpoint,
    ProgressBar,
    ThroughputMonitor,
)
from verl_trainer.engine import EngineConfig
from verl_trainer.training.launch import select_cluster_environment
from verl_trainer.training.strategy import Strategy, available_strategies

_CLUSTER_VARS = ("SLURM_NTASKS", "SLURM_JOB_NAME", "TORCHELASTIC_RUN_ID", "LSB_JOBID", "LOCAL_RANK")


@pytest.fixture(autouse=True)
def _no_cluster(monkeypatch):
    for name in _CLUSTER_VARS:
        monkeypatch.delenv(name, raising=False)


def test_defaults_and_callback_order(tmp_path):
    user = [ModelCheckpoint(every_n_train_steps=2), LearningRateMonitor(), ThroughputMonitor()]
    trainer = Trainer(max_steps=3, callbacks=user, default_root_dir=tmp_path)
    kinds = [type(cb) for cb in trainer.callbacks]
    assert kinds == [MetricReduction, LearningRateMonitor, ThroughputMonitor, ProgressBar, ModelCheckpoint]
    assert trainer.checkpoint_callback is user[0]
    assert trainer.precision == "32-true" and trainer.strategy.backend == "fsdp2"
    assert trainer.checkpoint_dir == tmp_path.absolute() / "checkpoints"


def test_disabled_defaults():
    trainer = Trainer(max_steps=1, enable_progress_bar=False, enable_checkpointing=False)
    assert [type(cb) for cb in trainer.callbacks] == [MetricReduction]


def test_unknown_strategy_lists_registered():
    with pytest.raises(ValueError, match="unknown strategy 'megatronish'") as info:
        Trainer(strategy="megatronish")
    for name in available_strategies():
        assert name in str(info.value)
    assert "fsdp2" in str(info.value)


@pytest.mark.parametrize("name", ["veomni", "automodel", "mindspeed"])
def test_verl_backends_not_built_here_are_refused_by_name(name):
    """The Trainer refuses them at construction (no model loaded): the need, the measure, the choice."""
    with pytest.raises(ValueError, match=rf"strategy '{name}' \(verl's {name} engine\).*needs .*Measured: .*"
                                         r"Use strategy='(fsdp2|megatron)'"):
        Trainer(strategy=name)


def test_strategy_object_and_bad_overrides():
    assert Trainer(strategy=Strategy("fsdp", engine_overrides={"zero_stage": 3})).strategy.backend == "fsdp"
    with pytest.raises(ValueError, match="unknown EngineConfig field"):
        Trainer(strategy=Strategy("fsdp2", engine_overrides={"no_such_field": 1}))
    with pytest.raises(TypeError, match="registered name"):
        Trainer(strategy=3)


def test_deepspeed_missing_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'verl-trainer\[deepspeed\]'"):
        Trainer(strategy="deepspeed_stage_2")


@pytest.mark.parametrize("precision", ["fp8", 64, "bf16-fancy"])
def test_bad_precision(precision):
    with pytest.raises(ValueError, match="precision=.*not supported; choose one of"):
        Trainer(precision=precision)


def test_precision_aliases():
    assert Trainer(precision=32).precision == "32-true"


def test_bf16_without_native_support(monkeypatch):
    monkeypatch.setattr("verl_trainer.training.strategy.bf16_supported", lambda device: False)
    with pytest.warns(UserWarning, match="without native bfloat16.*slower"):
        assert Trainer(precision="bf16-mixed", accelerator="cpu").precision == "bf16-mixed"
    with pytest.raises(ValueError, match="needs native bfloat16.*use precision='32-true' or 'bf16-mixed'"):
        Trainer(precision="bf16-true", accelerator="cpu")


@pytest.mark.parametrize("precision", ["16-mixed", 16, "16"])
def test_fp16_mixed_on_cpu(precision, monkeypatch):
    monkeypatch.setattr("verl_trainer.training.strategy.fp16_supported_on_cpu", lambda: False)
    with pytest.warns(UserWarning, match="without native float16.*slower"):
        assert Trainer(precision=precision, accelerator="cpu").precision == "16-mixed"
    with pytest.raises(ValueError, match="16-mixed.*'deepspeed'.*no float16.*use strategy='fsdp2'"):
        Trainer(precision=precision, accelerator="cpu", strategy="deepspeed")
    config = Strategy("fsdp2").engine_config(EngineConfig(), "16-mixed", seed=None)
    assert (config.param_dtype, config.reduce_dtype, config.model_dtype) == ("float16", "float32", "float32")
    with pytest.raises(ValueError, match="float16 compute.*tensor_model_parallel_size=2"):
        config.replace(tensor_model_parallel_size=2)


@pytest.mark.parametrize("devices", [0, -2, "two", 1.5, True])
def test_bad_devices(devices):
    with pytest.raises(ValueError, match="devices must be"):
        Trainer(devices=devices)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_without_cuda():
    with pytest.raises(ValueError, match="no CUDA device"):
        Trainer(accelerator="gpu")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_steps": 0}, "max_steps must be -1"),
        ({"max_epochs": 0}, "max_epochs must be None or >= 1"),
        ({"num_nodes": 0}, "num_nodes must be an int >= 1"),
        ({"log_every_n_steps": 0}, "log_every_n_steps"),
        ({"val_check_interval": 2.5}, "val_check_interval=2.5; use an int >= 1"),
        ({"accelerator": "tpu"}, "accelerator='tpu'"),
        ({"logger": "tensorbored"}, "unknown logger 'tensorbored'"),
        ({"callbacks": [ProgressBar()], "enable_progress_bar": False}, "enable_progress_bar=False"),
        ({"callbacks": [ModelCheckpoint()], "enable_checkpointing": False}, "enable_checkpointing=False"),
        ({"callbacks": [LearningRateMonitor(), LearningRateMonitor()]}, "share the state key"),
        ({"num_nodes": 2, "devices": 2}, "num_nodes > 1 needs a cluster launcher"),
    ],
)
def test_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Trainer(**kwargs)


def test_wrong_types():
    with pytest.raises(TypeError, match="logger must be"):
        Trainer(logger=5)
    with pytest.raises(TypeError, match="Callback instances"):
        Trainer(callbacks=[object()])


def test_fit_needs_a_stop_and_a_module():
    trainer = Trainer()
    with pytest.raises(ValueError, match="set max_steps or max_epochs"):
        trainer.fit(object())
    with pytest.raises(TypeError, match="not a training module"):
        Trainer(max_steps=1).fit(object())


def test_precision_conflicts_with_engine_config():
    strategy = Strategy("fsdp2")
    config = strategy.engine_config(EngineConfig(), "bf16-mixed", seed=3)
    assert (config.param_dtype, config.reduce_dtype, config.seed) == ("bfloat16", "float32", 3)
    with pytest.raises(ValueError, match="contradicts Trainer\\(precision='32-true'\\)"):
        strategy.engine_config(EngineConfig(param_dtype="bfloat16"), "32-true", seed=None)


def test_cluster_environments(monkeypatch):
    assert isinstance(select_cluster_environment(), LightningEnvironment)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert isinstance(select_cluster_environment(), TorchElasticEnvironment)
    with pytest.raises(ValueError, match="does not match the world size"):
        Trainer(devices=2)  # torchrun started 4 processes, the script asks for 2
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")
    monkeypatch.setenv("SLURM_NNODES", "1")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    assert isinstance(select_cluster_environment(), SLURMEnvironment)
    with pytest.raises(ValueError, match="ntasks-per-node=2"):
        Trainer(devices=4)


def test_callback_base_is_compatible():
    class Custom(Callback):
        pass

    cb = Custom()
    assert cb.state_dict() == {} and cb.state_key == "test_callback_base_is_compatible.<locals>.Custom"
    assert cb.on_before_update(None, None, "batch") is None


def test_call_before_update_is_an_alias_of_the_one_dispatch():
    """``call_hook("on_before_update", batch)`` is the spelling; the deprecated alias gives the same batch."""

    class Halve(Callback):
        def on_before_update(self, trainer, module, batch):
            return batch[: len(batch) // 2]

    trainer = Trainer(max_steps=1, enable_progress_bar=False, enable_checkpointing=False, callbacks=[Halve()])
    batch = list(range(8))
    assert trainer.call_hook("on_before_update", batch) == trainer.call_before_update(batch) == [0, 1, 2, 3]
