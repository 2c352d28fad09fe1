"""Callbacks named in a config (``trainer.callbacks``), like rewards, losses and estimators.

Each entry is a built-in callback's class name (``EarlyStopping``), or where a callback is defined:
``"package.module:Name"`` or ``"path/to/file.py:Name"`` (:func:`verl_trainer.utils.registry.load_object`);
either alone (built with no arguments) or as ``{name: ..., init_args: {...}}``::

    trainer:
      callbacks:
        - LearningRateMonitor
        - name: EarlyStopping
          init_args: {monitor: val/reward/mean, mode: max, patience: 3}
        - my_callbacks.py:CountTokens

``Name`` is a :class:`~verl_trainer.callbacks.Callback` subclass or a function returning one (called with
``init_args``), or a ``Callback`` instance (no ``init_args``). :func:`check_callback_specs` resolves every
entry and binds its arguments when the config is built, before any model loads;
:func:`build_callbacks` makes the callbacks when the Trainer is built.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from verl_trainer import callbacks
from verl_trainer.callbacks import Callback
from verl_trainer.utils.registry import is_object_path, load_object

__all__ = ["build_callbacks", "check_callback_specs"]

_KIND = "callback"


def _name_and_args(spec: Any, where: str) -> tuple[str, dict[str, Any]]:
    if isinstance(spec, str) and spec:
        return spec, {}
    if isinstance(spec, Mapping) and isinstance(spec.get("name"), str) and set(spec) <= {"name", "init_args"}:
        init_args = spec.get("init_args") or {}
        if isinstance(init_args, Mapping):
            return spec["name"], dict(init_args)
    raise ValueError(f"{where}={spec!r}: give a callback name ('EarlyStopping', 'module:Name', "
                     "'file.py:Name') or {name: ..., init_args: {...}}")


def _resolve(name: str, where: str) -> Any:
    """The class, factory or instance ``name`` names (a built-in by class name, or ``module:Name``)."""
    if is_object_path(name):
        try:
            return load_object(name, _KIND)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
    builtin = getattr(callbacks, name, None) if name in callbacks.__all__ else None
    if not (isinstance(builtin, type) and issubclass(builtin, Callback)):
        names = [n for n in callbacks.__all__ if isinstance(getattr(callbacks, n), type)
                 and issubclass(getattr(callbacks, n), Callback) and n != "Callback"]
        raise ValueError(f"{where}={name!r} is no built-in callback ({', '.join(names)}); name your own as "
                         "'package.module:Name' or 'path/to/file.py:Name'")
    return builtin


def _checked(spec: Any, where: str) -> tuple[Any, dict[str, Any]]:
    """``(object, init_args)`` of one entry, its arguments bound to the object's signature."""
    name, init_args = _name_and_args(spec, where)
    obj = _resolve(name, where)
    if isinstance(obj, Callback):
        if init_args:
            raise ValueError(f"{where}: {name!r} is a callback instance; it takes no init_args")
        return obj, {}
    if not callable(obj):
        raise ValueError(f"{where}: {name!r} is a {type(obj).__name__}, not a Callback class, a function "
                         "returning one, or a Callback instance")
    try:
        inspect.signature(obj).bind(**init_args)
    except TypeError as err:
        raise ValueError(f"{where}: {name!r} cannot take init_args {init_args} ({err})") from None
    except ValueError:  # no signature to read (a builtin): the call will tell
        pass
    return obj, init_args


def check_callback_specs(specs: Sequence[Any], key: str = "trainer.callbacks") -> None:
    """Resolve every entry and bind its arguments (imports the modules and files named; builds nothing).

    Raises:
        ValueError: A malformed entry, an unknown built-in, a module, file or attribute that is not there,
            an object that is no callback, or arguments it does not take; the message names the entry.
    """
    for i, spec in enumerate(specs):
        _checked(spec, f"{key}[{i}]")


def build_callbacks(specs: Sequence[Any], key: str = "trainer.callbacks") -> list[Callback]:
    """The callbacks the entries name, in order.

    Raises:
        ValueError: As :func:`check_callback_specs`, or a factory that returned no ``Callback``.
    """
    built = []
    for i, spec in enumerate(specs):
        where = f"{key}[{i}]"
        obj, init_args = _checked(spec, where)
        callback = obj if isinstance(obj, Callback) else obj(**init_args)
        if not isinstance(callback, Callback):
            raise ValueError(f"{where}: {spec!r} returned a {type(callback).__name__}, not a Callback")
        built.append(callback)
    return built
