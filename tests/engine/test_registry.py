"""EngineRegistry: product registration, the three lookup levels, env overrides, presets, errors."""

from __future__ import annotations

import importlib.util

import pytest

import verl_trainer
from verl_trainer.engine import EngineRegistry, MissingBackendError
from verl_trainer.engine import registry as registry_mod
from verl_trainer.utils import device as device_mod


class _Dummy:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


@pytest.fixture
def scratch():
    """Register test engines and remove them afterwards."""
    before = set(EngineRegistry.registered())
    yield EngineRegistry
    for key in set(EngineRegistry.registered()) - before:
        EngineRegistry.unregister(*key)


@pytest.fixture
def on(monkeypatch):
    """Pretend to run on (device, vendor) through the env overrides."""

    def set_(device: str, vendor: str | None = None) -> None:
        monkeypatch.setenv("VERL_ENGINE_DEVICE", device)
        if vendor is None:
            monkeypatch.delenv("VERL_ENGINE_VENDOR", raising=False)
        else:
            monkeypatch.setenv("VERL_ENGINE_VENDOR", vendor)

    return set_


def test_builtin_engines_are_registered_and_package_imports_lazily():
    assert EngineRegistry is verl_trainer.EngineRegistry
    for model_type in ("language_model", "value_model"):
        for backend in ("fsdp", "fsdp2"):
            for device in ("cpu", "cuda", "npu"):
                assert (model_type, backend, device, None) in EngineRegistry.registered()
    cls = EngineRegistry.get_engine_cls("language_model", "fsdp2")
    assert cls is EngineRegistry.get_engine_cls("language_model", "fsdp")
    assert cls is EngineRegistry.get_engine_cls("value_model", "fsdp2")  # one class per backend
    config = verl_trainer.engine.EngineConfig(model_path="unused")
    for model_type in ("language_model", "value_model"):
        assert EngineRegistry.new(model_type, "fsdp2", config).MODEL_TYPE == model_type


def test_one_call_registers_the_whole_product(scratch):
    scratch.register(model_type=["language_model", "value_model"], backend=["t_a", "t_b"],
                     device=["cpu", "cuda"], vendor=None)(_Dummy)
    keys = [k for k in scratch.registered() if k[1] in ("t_a", "t_b")]
    assert len(keys) == 8


def test_duplicate_registration_raises(scratch):
    scratch.register("language_model", "t_dup", "cpu")(_Dummy)

    class Other(_Dummy):
        pass

    with pytest.raises(ValueError, match=r"already registered.*_Dummy"):
        scratch.register("language_model", ["t_dup2", "t_dup"], "cpu")(Other)
    # nothing of the failed call was registered
    assert ("language_model", "t_dup2", "cpu", None) not in scratch.registered()


def test_level1_exact_device_and_vendor_wins(scratch, on):
    class Generic(_Dummy):
        pass

    class Amd(_Dummy):
        pass

    scratch.register("language_model", "t_lvl", "cuda")(Generic)
    scratch.register("language_model", "t_lvl", "cuda", vendor="amd")(Amd)
    on("cuda", "amd")
    assert scratch.get_engine_cls("language_model", "t_lvl") is Amd


def test_level2_device_alone(scratch, on):
    scratch.register("language_model", "t_lvl2", "npu")(_Dummy)
    on("npu", "huawei")
    assert scratch.get_engine_cls("language_model", "t_lvl2") is _Dummy


def test_level3_cuda_non_nvidia_falls_back_to_nvidia(scratch, on):
    class Nvidia(_Dummy):
        pass

    scratch.register("language_model", "t_lvl3", "cuda", vendor="nvidia")(Nvidia)
    on("cuda", "amd")  # faked: a ROCm machine
    assert scratch.get_engine_cls("language_model", "t_lvl3") is Nvidia
    on("cuda", "nvidia")
    assert scratch.get_engine_cls("language_model", "t_lvl3") is Nvidia
    on("npu", "huawei")  # the fallback is for cuda only
    with pytest.raises(ValueError, match="no engine registered"):
        scratch.get_engine_cls("language_model", "t_lvl3")


def test_env_overrides_detection(scratch, on, monkeypatch):
    class Cpu(_Dummy):
        pass

    class Cuda(_Dummy):
        pass

    scratch.register("language_model", "t_env", "cpu")(Cpu)
    scratch.register("language_model", "t_env", "cuda")(Cuda)
    monkeypatch.delenv("VERL_ENGINE_DEVICE", raising=False)
    monkeypatch.delenv("VERL_ENGINE_VENDOR", raising=False)
    monkeypatch.setattr(device_mod, "get_device_name", lambda: "cpu")
    assert scratch.get_engine_cls("language_model", "t_env") is Cpu
    on("cuda")
    assert scratch.get_engine_cls("language_model", "t_env") is Cuda
    assert device_mod.detect_device_and_vendor() == ("cuda", "nvidia")
    on("cuda", "amd")
    assert device_mod.detect_device_and_vendor() == ("cuda", "amd")
    on("tpu")
    with pytest.raises(ValueError, match="VERL_ENGINE_DEVICE='tpu'"):
        scratch.get_engine_cls("language_model", "t_env")


def test_miss_names_the_request_and_lists_everything_registered(scratch, on):
    scratch.register("value_model", "t_miss", "cuda", vendor="amd")(_Dummy)
    on("cpu")
    with pytest.raises(ValueError) as err:
        scratch.get_engine_cls("language_model", "t_nope")
    msg = str(err.value)
    assert "model_type='language_model'" in msg and "backend='t_nope'" in msg and "device='cpu'" in msg
    for model_type, backend, device, vendor in scratch.registered():
        assert (f"(model_type={model_type!r}, backend={backend!r}, device={device!r}, "
                f"vendor={vendor!r})") in msg


def test_missing_package_names_the_extra(scratch, on, monkeypatch):
    on("cpu")
    real = importlib.util.find_spec
    monkeypatch.setattr(registry_mod.importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else real(name, *a))
    hint = r"needs the package 'deepspeed'.*verl-trainer\[deepspeed\]"
    with pytest.raises(MissingBackendError, match=hint):
        scratch.get_engine_cls("language_model", "deepspeed_stage_9")
    assert issubclass(MissingBackendError, ImportError) and issubclass(MissingBackendError, ValueError)


def test_unserved_verl_backends_name_their_needs_and_the_alternative(on):
    from verl_trainer.engine.registry import UnservedBackendError
    from verl_trainer.engine.unserved import UNSERVED_BACKENDS

    on("cpu")
    assert sorted(UNSERVED_BACKENDS) == ["automodel", "mindspeed", "veomni"]
    for name, entry in UNSERVED_BACKENDS.items():
        assert name not in EngineRegistry.backends()
        with pytest.raises(UnservedBackendError) as info:
            EngineRegistry.new("language_model", name, "cfg")
        text = str(info.value)
        assert entry.needs in text and entry.measured in text and entry.instead in text


def test_new_passes_backend_and_alias_presets(scratch, on):
    on("cpu")
    scratch.register("language_model", "t_new", "cpu")(_Dummy)
    scratch.register("language_model", "t_new_stage_3", "cpu", preset={"zero_stage": 3})(_Dummy)
    plain = scratch.new("language_model", "t_new", "cfg", extra=1)
    assert plain.args == ("cfg",)
    assert plain.kwargs == {"backend": "t_new", "model_type": "language_model", "extra": 1}
    alias = scratch.new("language_model", "t_new_stage_3", "cfg")
    assert alias.kwargs == {"backend": "t_new_stage_3", "model_type": "language_model", "zero_stage": 3}
    assert scratch.new("language_model", "t_new_stage_3", "cfg", zero_stage=3).kwargs["zero_stage"] == 3
    with pytest.raises(ValueError, match="presets zero_stage=3"):
        scratch.new("language_model", "t_new_stage_3", "cfg", zero_stage=2)


def test_new_builds_a_real_engine_with_config_overrides(tmp_path):
    from verl_trainer.engine import EngineConfig, OptimConfig

    engine = EngineRegistry.new("value_model", "fsdp", EngineConfig(model_path=str(tmp_path)), OptimConfig(),
                                micro_batch_size_per_gpu=3)
    assert engine.backend == "fsdp" and engine.is_fsdp1
    assert engine.config.micro_batch_size_per_gpu == 3
    with pytest.raises(ValueError, match="unknown EngineConfig field"):
        EngineRegistry.new("value_model", "fsdp2", EngineConfig(), nonsense=1)


def test_import_without_deepspeed_is_fine_and_names_the_extra():
    """A fresh interpreter where ``import deepspeed`` fails: the package imports, the registry explains."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['deepspeed'] = None\n"
        "import verl_trainer, verl_trainer.engine as e\n"
        "assert e.DeepSpeedEngine is None\n"
        "try:\n"
        "    verl_trainer.EngineRegistry.get_engine_cls('language_model', 'deepspeed_stage_3')\n"
        "except e.MissingBackendError as err:\n"
        "    print(err)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"VERL_ENGINE_DEVICE": "cpu", "PATH": ""}, check=True)
    assert "pip install 'verl-trainer[deepspeed]'" in out.stdout
