"""Optimizers by name: the registry behind ``OptimConfig.optimizer`` and the arguments each class gets.

``OptimConfig.optimizer`` names a torch optimizer class, as verl's ``optim.optimizer`` does:

* a registered name (:data:`OPTIMIZERS`): ``"adamw"`` (the default), ``"adam"``, ``"sgd"``; case does not
  matter, so verl's spellings ``AdamW`` / ``Adam`` / ``SGD`` work; HF / TRL's ``optim="adamw_torch"`` and
  ``"adamw_torch_fused"`` are AdamW;
* another class of ``torch.optim`` by its name (``RMSprop``, ``Adagrad``, ...), or of the module
  ``OptimConfig.optimizer_impl`` names (verl's key: ``optimizer_impl=bitsandbytes.optim
  optimizer=AdamW8bit``);
* ``"package.module:Class"`` or ``"path/to/file.py:Class"``: any ``torch.optim.Optimizer`` subclass.

Each class gets ``lr``, then ``betas``, ``eps`` and ``weight_decay`` where its constructor takes them
(SGD takes no betas or eps), then ``OptimConfig.override_optimizer_config`` on top (verl's key: ``momentum``,
``nesterov``, ``amsgrad``, ...). Adam and AdamW use torch's fused kernel where it exists, else ``foreach``.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from verl_trainer.utils.registry import Registry, UnknownKeyError, is_object_path, load_object

__all__ = ["DEFAULT_IMPL", "OPTIMIZERS", "OptimizerSettings", "build_optimizer", "optimizer_kwargs",
           "resolve_optimizer"]

DEFAULT_IMPL = "torch.optim"
"""``OptimConfig.optimizer_impl`` default: names are looked up in the registry, then in ``torch.optim``."""

OPTIMIZERS: Registry[type[torch.optim.Optimizer]] = Registry("optimizer")
OPTIMIZERS.add("adamw", torch.optim.AdamW)
OPTIMIZERS.add("adam", torch.optim.Adam)
OPTIMIZERS.add("sgd", torch.optim.SGD)
OPTIMIZERS.add("adamw_torch", torch.optim.AdamW)  # HF TrainingArguments' / TRL's optim= names
OPTIMIZERS.add("adamw_torch_fused", torch.optim.AdamW)


class OptimizerSettings(Protocol):
    """What building an optimizer reads of a config: these fields of ``engine.config.OptimConfig``."""

    optimizer: str
    optimizer_impl: str
    override_optimizer_config: dict[str, Any]
    lr: float
    betas: tuple[float, float]
    weight_decay: float
    eps: float


_FUSED = (torch.optim.AdamW, torch.optim.Adam)
"""Classes built with ``fused=True`` first (the fused kernel takes FSDP2's DTensor parameters)."""


def _choices() -> str:
    return (f"registered: {OPTIMIZERS.keys_repr()} (any case); another torch.optim class by name (e.g. "
            f"'RMSprop'); or 'package.module:Class' / 'path/to/file.py:Class' for any torch.optim.Optimizer "
            f"subclass")


def resolve_optimizer(name: str, impl: str = DEFAULT_IMPL) -> type[torch.optim.Optimizer]:
    """The optimizer class ``name`` names (see the module docstring).

    Args:
        name: A registered name, a class name of ``impl`` or ``torch.optim``, or ``"module:Class"`` /
            ``"file.py:Class"``.
        impl: verl's ``optimizer_impl``: the module a plain class name is taken from first.

    Raises:
        UnknownKeyError: An unknown name (a ``ValueError``); the message lists the valid names.
        ValueError: A module or file that does not exist, or an object that is not an optimizer class.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"optim.optimizer={name!r}; {_choices()}")
    if is_object_path(name):
        cls = load_object(name, "optimizer")
    elif impl != DEFAULT_IMPL:
        cls = load_object(f"{impl}:{name}", f"optimizer (optimizer_impl={impl!r})")
    elif name.lower() in OPTIMIZERS:
        cls = OPTIMIZERS[name.lower()]
    else:
        cls = getattr(importlib.import_module(DEFAULT_IMPL), name, None)
        if cls is None:
            raise UnknownKeyError(f"unknown optimizer: optim.optimizer={name!r}; {_choices()}")
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
        raise ValueError(f"optim.optimizer={name!r} is {cls!r}, not a torch.optim.Optimizer subclass; "
                         f"{_choices()}")
    return cls


def optimizer_kwargs(cls: type[torch.optim.Optimizer], config: OptimizerSettings) -> dict[str, Any]:
    """The keyword arguments ``cls`` is built with from ``config`` (without the parameters).

    ``lr``; ``betas`` / ``eps`` / ``weight_decay`` where ``cls.__init__`` names them; then
    ``config.override_optimizer_config`` (which wins).
    """
    accepted = inspect.signature(cls.__init__).parameters
    kwargs: dict[str, Any] = {"lr": config.lr}
    common = {"betas": tuple(config.betas), "eps": config.eps, "weight_decay": config.weight_decay}
    kwargs.update({key: value for key, value in common.items() if key in accepted})
    kwargs.update(config.override_optimizer_config)
    return kwargs


def build_optimizer(params: Iterable[torch.nn.Parameter], config: OptimizerSettings) -> torch.optim.Optimizer:
    """``config.optimizer`` over the trainable ``params`` (weight decay on every parameter, as verl does).

    Adam / AdamW use the fused kernel (CPU and CUDA; it takes FSDP2's DTensor parameters), equal to
    torch's per-tensor loop up to round-off; where it is not available (another device, a non-float
    parameter) the multi-tensor ``foreach`` implementation is used, as for every other class that has one.
    ``fused`` / ``foreach`` in ``override_optimizer_config`` are kept as given.

    Args:
        params: Parameters (plain or DTensor); those without ``requires_grad`` are left out.
        config: The optimizer config (an ``OptimConfig``).
    """
    cls = resolve_optimizer(config.optimizer, config.optimizer_impl)
    trainable = [p for p in params if p.requires_grad]
    kwargs = optimizer_kwargs(cls, config)
    accepted = inspect.signature(cls.__init__).parameters
    chosen = "fused" in kwargs or "foreach" in kwargs
    if not chosen and issubclass(cls, _FUSED):
        try:
            return cls(trainable, fused=True, **kwargs)
        except (RuntimeError, ValueError):
            pass
    if not chosen and "foreach" in accepted:
        kwargs["foreach"] = True
    return cls(trainable, **kwargs)
