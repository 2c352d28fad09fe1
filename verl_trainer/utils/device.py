"""Device and vendor detection for the engine registry.

``get_device_name()`` returns ``"cuda"``, ``"npu"`` or ``"cpu"``; ``get_vendor()`` returns
``"nvidia"`` or ``"amd"`` for CUDA devices (ROCm builds of torch report ``torch.version.hip``), and
``None`` otherwise. The environment variables ``VERL_ENGINE_DEVICE`` and ``VERL_ENGINE_VENDOR``
override both (the engine registry reads them through :func:`detect_device_and_vendor`).
"""

from __future__ import annotations

import os

import torch

DEVICE_ENV = "VERL_ENGINE_DEVICE"
VENDOR_ENV = "VERL_ENGINE_VENDOR"
KNOWN_DEVICES = ("cpu", "cuda", "npu")


def is_npu_available() -> bool:
    """True when torch_npu is installed and an Ascend NPU is visible."""
    npu = getattr(torch, "npu", None)
    try:
        return bool(npu is not None and npu.is_available())
    except Exception:  # torch_npu raises on broken driver installs
        return False


def get_device_name() -> str:
    """The accelerator this process would use: ``"cuda"``, ``"npu"`` or ``"cpu"``."""
    if torch.cuda.is_available():
        return "cuda"
    if is_npu_available():
        return "npu"
    return "cpu"


def get_vendor(device: str | None = None) -> str | None:
    """The vendor of ``device`` (default: the detected device).

    Returns:
        ``"amd"`` for a ROCm build, ``"nvidia"`` for other CUDA builds, ``"huawei"`` for NPU,
        ``None`` for CPU.
    """
    device = device or get_device_name()
    if device == "cuda":
        return "amd" if getattr(torch.version, "hip", None) else "nvidia"
    if device == "npu":
        return "huawei"
    return None


def detect_device_and_vendor() -> tuple[str, str | None]:
    """Detected (device, vendor) with ``VERL_ENGINE_DEVICE`` / ``VERL_ENGINE_VENDOR`` applied.

    Raises:
        ValueError: If ``VERL_ENGINE_DEVICE`` names an unknown device.
    """
    device = os.environ.get(DEVICE_ENV) or get_device_name()
    if device not in KNOWN_DEVICES:
        raise ValueError(
            f"{DEVICE_ENV}={device!r} is not a known device; choose one of {KNOWN_DEVICES} "
            f"or unset the variable to auto-detect."
        )
    vendor = os.environ.get(VENDOR_ENV) or get_vendor(device)
    return device, vendor


def get_torch_device(device: str | None = None) -> torch.device:
    """A ``torch.device`` for this process's local rank on ``device`` (default: detected)."""
    device = device or get_device_name()
    if device == "cpu":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device(device, local_rank)


def default_dist_backend(device: str | None = None) -> str:
    """The collective backend for ``device``: nccl on CUDA, hccl on NPU, gloo on CPU."""
    device = device or get_device_name()
    return {"cuda": "nccl", "npu": "hccl"}.get(device, "gloo")
