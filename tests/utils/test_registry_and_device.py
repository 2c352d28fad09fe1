import pytest
import torch

from verl_trainer.utils import device as dev
from verl_trainer.utils.registry import Registry, as_list


def test_registry_register_get_and_errors():
    reg: Registry = Registry("reward function")

    @reg.register("exact", "exact_match")
    def exact():
        return 1

    assert reg.get("exact") is exact and reg.get("exact_match") is exact
    assert list(reg.keys()) == ["exact", "exact_match"] and "exact" in reg
    with pytest.raises(ValueError, match=r"reward function 'exact' is already registered"):
        reg.add("exact", lambda: 0)
    with pytest.raises(ValueError, match=r"unknown reward function 'nope'; registered: 'exact', 'exact_m"):
        reg.get("nope")
    assert reg.remove("exact") is exact and "exact" not in reg


def test_as_list():
    assert as_list("a") == ["a"] and as_list(None) == [None] and as_list(("a", "b")) == ["a", "b"]


def test_detection_on_this_machine(monkeypatch):
    monkeypatch.delenv(dev.DEVICE_ENV, raising=False)
    monkeypatch.delenv(dev.VENDOR_ENV, raising=False)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert dev.get_device_name() == expected
    assert dev.detect_device_and_vendor()[0] == expected
    if expected == "cpu":
        assert dev.get_vendor() is None and dev.default_dist_backend() == "gloo"
        assert dev.get_torch_device() == torch.device("cpu")


def test_vendor_of_cuda_builds(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert dev.get_vendor("cuda") == "nvidia"
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    assert dev.get_vendor("cuda") == "amd"
    assert dev.get_vendor("npu") == "huawei"
    assert dev.default_dist_backend("cuda") == "nccl" and dev.default_dist_backend("npu") == "hccl"


def test_env_overrides(monkeypatch):
    monkeypatch.setenv(dev.DEVICE_ENV, "cuda")
    monkeypatch.setenv(dev.VENDOR_ENV, "amd")
    assert dev.detect_device_and_vendor() == ("cuda", "amd")
    monkeypatch.delenv(dev.VENDOR_ENV)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert dev.detect_device_and_vendor() == ("cuda", "nvidia")
    monkeypatch.setenv(dev.DEVICE_ENV, "tpu")
    with pytest.raises(ValueError, match=r"VERL_ENGINE_DEVICE='tpu' is not a known device; choose one of"):
        dev.detect_device_and_vendor()


def test_registry_behaves_as_a_dict():
    reg = Registry("thing")
    reg["a"] = 1
    reg.add("b", 2)
    assert "a" in reg and [k for k in reg] == ["a", "b"] and len(reg) == 2 and dict(reg) == {"a": 1, "b": 2}
    assert reg["b"] == 2 and reg.get("zz", None) is None and reg.get("a") == 1
    with pytest.raises(KeyError, match="unknown thing 'zz'; registered: 'a', 'b'"):
        reg["zz"]
    with pytest.raises(ValueError, match="unknown thing 'zz'"):
        reg.get("zz")
    with pytest.raises(ValueError, match="already registered"):
        reg["a"] = 3
    del reg["a"]
    assert list(reg) == ["b"]
    reg.clear()
    assert len(reg) == 0 and [] not in reg
