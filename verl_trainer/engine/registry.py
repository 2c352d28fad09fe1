"""``EngineRegistry``: engines keyed on (model_type, backend, device, vendor).

Registration is a class decorator whose arguments each take a string or a list; one call registers the
whole product::

    @EngineRegistry.register(model_type=["language_model", "value_model"], backend=["fsdp", "fsdp2"],
                             device=["cuda", "npu", "cpu"])
    class FSDPEngine(...): ...

Aliases are entries with preset constructor arguments (``preset={"zero_stage": 3}``); the lookup order is
:meth:`EngineRegistry.get_entry`'s.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from verl_trainer.engine.unserved import unserved_backend_message
from verl_trainer.utils.device import detect_device_and_vendor
from verl_trainer.utils.registry import Registry, as_list

if TYPE_CHECKING:
    from verl_trainer.engine.base import BaseEngine

T = TypeVar("T", bound=type)

# backend name prefix -> (python package it needs, pip extra that installs it)
BACKEND_PACKAGES: dict[str, tuple[str, str]] = {
    "deepspeed": ("deepspeed", "deepspeed"),
    "megatron": ("megatron.core", "megatron"),
    "torchtitan": ("torchtitan", "torchtitan"),
}

EngineKey = tuple[str, str, str, "str | None"]


class MissingBackendError(ValueError, ImportError):
    """The asked backend needs a package that is not installed (the message names the extra)."""


class UnservedBackendError(ValueError):
    """The asked backend is one of verl's that is not built here (``engine/unserved.py`` says why)."""


@dataclass(frozen=True)
class EngineEntry:
    """One registry entry: the engine class and the constructor arguments its alias presets."""

    cls: type
    preset: dict[str, Any] = field(default_factory=dict)


def missing_package(backend: str) -> tuple[str, str] | None:
    """(package, extra) when ``backend`` needs a package that is not importable, else ``None``."""
    for prefix, (package, extra) in BACKEND_PACKAGES.items():
        if backend == prefix or backend.startswith(prefix + "_"):
            try:
                found = importlib.util.find_spec(package) is not None
            except (ImportError, ValueError):
                found = False
            return None if found else (package, extra)
    return None


class EngineRegistry:
    """Class-level registry of engine classes (no instances needed)."""

    _registry: Registry[EngineEntry] = Registry("engine")

    @classmethod
    def register(
        cls,
        model_type: str | Iterable[str],
        backend: str | Iterable[str],
        device: str | Iterable[str],
        vendor: str | Iterable[str] | None = None,
        preset: dict[str, Any] | None = None,
    ) -> Callable[[T], T]:
        """Class decorator registering the engine for every combination of the arguments.

        Args:
            model_type: ``"language_model"`` / ``"value_model"`` or a list.
            backend: Backend name(s), e.g. ``["fsdp", "fsdp2"]``.
            device: ``"cpu"``, ``"cuda"``, ``"npu"`` or a list.
            vendor: Vendor(s) (``"nvidia"``, ``"amd"``, ...) or ``None`` for "any vendor of the device".
            preset: Constructor keyword arguments :meth:`new` passes (aliases such as
                ``deepspeed_stage_3`` preset ``{"zero_stage": 3}``).

        Raises:
            ValueError: If one of the combinations is already registered.

        """
        keys = [
            (m, b, d, v)
            for m in as_list(model_type)
            for b in as_list(backend)
            for d in as_list(device)
            for v in as_list(vendor)
        ]
        for key in keys:
            if None in key[:3]:
                raise ValueError(f"model_type, backend and device must be given, got {key}")

        def deco(engine_cls: T) -> T:
            taken = [k for k in keys if k in cls._registry]
            if taken:
                raise ValueError(
                    f"engine {taken[0]} is already registered (by "
                    f"{cls._registry.get(taken[0]).cls.__qualname__}); pick another backend name or "
                    f"unregister the earlier engine first"
                )
            for key in keys:
                cls._registry.add(key, EngineEntry(engine_cls, dict(preset or {})))
            return engine_cls

        return deco

    @classmethod
    def unregister(cls, model_type: str, backend: str, device: str, vendor: str | None = None) -> None:
        """Remove one entry (for tests and plugins)."""
        cls._registry.remove((model_type, backend, device, vendor))

    @classmethod
    def registered(cls) -> list[EngineKey]:
        """Every registered (model_type, backend, device, vendor), in registration order."""
        return list(cls._registry.keys())  # type: ignore[arg-type]

    @classmethod
    def backend_class(cls, backend: str) -> type | None:
        """The engine class first registered under the backend name ``backend``, or ``None``."""
        for key in cls._registry.keys():
            if key[1] == backend:
                return cls._registry.get(key).cls
        return None

    @classmethod
    def backends(cls, capability: str | None = None) -> list[str]:
        """The registered backend names, sorted; with ``capability``, those whose class sets it true.

        Args:
            capability: A class attribute of the backend (``"RESHARDABLE_CHECKPOINTS"``, ...).
        """
        names = sorted({key[1] for key in cls._registry.keys()})
        if capability is None:
            return names
        return [name for name in names if getattr(cls.backend_class(name), capability, False)]

    @classmethod
    def get_entry(cls, model_type: str, backend: str) -> EngineEntry:
        """Look up the entry for ``(model_type, backend)`` on this machine's device and vendor.

        The device and vendor are detected (``VERL_ENGINE_DEVICE`` / ``VERL_ENGINE_VENDOR`` override them);
        tried in order: the exact (device, vendor), the device alone (``vendor=None``), and for ``cuda``
        with a vendor other than ``nvidia``, (``cuda``, ``nvidia``).

        Raises:
            MissingBackendError: If the backend's package is not installed.
            UnservedBackendError: If the backend is one of verl's not built here (veomni, automodel,
                mindspeed): what it needs, what was measured, what to use instead.
            ValueError: If nothing matches; the message lists every registered entry.

        """
        device, vendor = detect_device_and_vendor()
        candidates: list[EngineKey] = [(model_type, backend, device, vendor)]
        if vendor is not None:
            candidates.append((model_type, backend, device, None))
        if device == "cuda" and vendor != "nvidia":
            candidates.append((model_type, backend, "cuda", "nvidia"))
        for key in candidates:
            if key in cls._registry:
                return cls._registry.get(key)
        unserved = unserved_backend_message(backend)
        if unserved is not None:
            raise UnservedBackendError(unserved)
        missing = missing_package(backend)
        if missing is not None:
            package, extra = missing
            raise MissingBackendError(
                f"engine backend {backend!r} needs the package {package!r}, which is not installed; "
                f"install it with `pip install 'verl-trainer[{extra}]'`"
            )
        listing = "\n  ".join(
            f"(model_type={k[0]!r}, backend={k[1]!r}, device={k[2]!r}, vendor={k[3]!r})"
            for k in cls.registered()
        ) or "(none)"
        raise ValueError(
            f"no engine registered for model_type={model_type!r}, backend={backend!r} on "
            f"device={device!r}, vendor={vendor!r} (tried {candidates}). Registered engines:\n  {listing}\n"
            f"Pick one of these, or set VERL_ENGINE_DEVICE / VERL_ENGINE_VENDOR to override detection."
        )

    @classmethod
    def get_engine_cls(cls, model_type: str, backend: str) -> type:
        """Return the engine class for ``(model_type, backend)`` on this device (see :meth:`get_entry`)."""
        return cls.get_entry(model_type, backend).cls

    @classmethod
    def new(cls, model_type: str, backend: str, *args: Any, **kwargs: Any) -> BaseEngine:
        """Build: ``engine_cls(*args, backend=backend, model_type=model_type, **preset, **kwargs)``.

        One backend class serves every model type it is registered for: the name it is built for is
        passed on (its model-type part, ``engine/heads.py``).

        Raises:
            ValueError: If ``kwargs`` contradicts the alias's preset (e.g. ``zero_stage=2`` for
                ``deepspeed_stage_3``).

        """
        entry = cls.get_entry(model_type, backend)
        for key, value in entry.preset.items():
            if key in kwargs and kwargs[key] != value:
                raise ValueError(
                    f"backend {backend!r} presets {key}={value!r}, but {key}={kwargs[key]!r} was passed; "
                    f"drop the argument or choose a backend without that preset"
                )
        merged = {"backend": backend, "model_type": model_type, **entry.preset, **kwargs}
        return entry.cls(*args, **merged)
