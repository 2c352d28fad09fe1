"""The rollout-backend registry: ``algorithm.rollout.name`` to a :class:`BaseRollout` subclass.

A backend is one class and its registration (``docs/rollout.md``, "How to add a rollout backend")::

    @register_rollout("mine")
    class MyRollout(HFRollout): ...

The built-in ``hf`` and ``vllm`` backends register themselves when :mod:`verl_trainer.rollout` is imported
(``rollout/vllm_rollout.py`` imports vllm only when an engine is built, so registering it needs no vllm).
A config names a backend by its registered name, or by where its class is defined without registering
it: ``"package.module:Class"`` or ``"path/to/file.py:Class"`` (:func:`rollout_class`). ``"auto"`` is no
backend but a rule over the registered ones (:func:`verl_trainer.rollout.resolve_rollout_name`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from verl_trainer.rollout.base import BaseRollout
from verl_trainer.utils.registry import Registry, UnknownKeyError, is_object_path, keys_repr

R = TypeVar("R", bound=type[BaseRollout])

AUTO = "auto"
"""The name that picks a registered backend where the run happens instead of naming one."""

ROLLOUT_REGISTRY: Registry[type[BaseRollout]] = Registry("rollout backend")
"""Registered backend classes by name (``hf``, ``vllm`` and any a plugin registers)."""


def register_rollout(*names: str) -> Callable[[R], R]:
    """Class decorator: register a :class:`BaseRollout` subclass under ``names``.

    Raises:
        ValueError: A taken name, ``"auto"``, a name with ``":"`` (it would read as ``module:Class``), or a
            class that is not a :class:`BaseRollout` subclass.
    """
    for name in names:
        if name == AUTO or is_object_path(name):
            raise ValueError(f"rollout backend name {name!r} is reserved ('auto' and 'module:Class' forms); "
                             "choose another name")

    def deco(cls: R) -> R:
        _check_class(cls, getattr(cls, "__qualname__", repr(cls)))
        for name in names:
            ROLLOUT_REGISTRY.add(name, cls)
        return cls

    return deco


def rollout_class(name: str) -> type[BaseRollout]:
    """The backend class ``name`` names: a registered name, ``"module:Class"`` or ``"file.py:Class"``.

    A module or file is imported here, so a wrong name fails when the config is read, before a model loads.

    Raises:
        UnknownKeyError: An unregistered name (a ``ValueError``); the message lists the registered names
            and the other forms.
        ValueError: A module, file or attribute that does not exist, or an object that is not a
            :class:`BaseRollout` subclass.
    """
    if is_object_path(name):
        cls = ROLLOUT_REGISTRY.resolve(name)
        _check_class(cls, name)
        return cls
    if name not in ROLLOUT_REGISTRY:
        raise UnknownKeyError(
            f"rollout name={name!r} is unknown; registered: {keys_repr([*ROLLOUT_REGISTRY, AUTO])}. Use one "
            "of these, 'package.module:Class' or 'path/to/file.py:Class' naming a BaseRollout subclass, or "
            "register your own (docs/rollout.md: how to add a rollout backend)"
        )
    return ROLLOUT_REGISTRY[name]


def backend_only_settings() -> list[str]:
    """The :class:`RolloutConfig` fields some registered backend reads and another may not, in order."""
    return list(dict.fromkeys(s for cls in ROLLOUT_REGISTRY.values() for s in cls.backend_settings))


def _check_class(obj: object, name: str) -> None:
    if not (isinstance(obj, type) and issubclass(obj, BaseRollout)):
        raise ValueError(f"rollout backend {name!r} is {obj!r}, not a subclass of "
                         "verl_trainer.rollout.BaseRollout (or HFRollout)")
