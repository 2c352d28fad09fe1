"""The reward-function registry, and resolving ``"name"`` / ``"module.path:function"`` to a function.

A reward function follows verl's ``compute_score`` signature (below) or TRL's batched one
(:mod:`verl_trainer.rewards.signature`), so functions written for verl or TRL work here::

    def my_reward(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: dict | None = None) -> float | dict:
        ...

It returns the scalar score of one response, or a dict with a ``"score"`` entry and any other numbers
to log (e.g. ``"acc"``: logged as ``reward/accuracy``). ``extra_info`` is passed only when the function
accepts it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl_trainer.rewards.signature import reward_style
from verl_trainer.utils.registry import Registry

RewardFn = Callable[..., float | dict[str, Any]]

REWARD_REGISTRY: Registry[RewardFn] = Registry("reward function")
"""Built-in and user-registered reward functions, by name. The built-ins register when
``verl_trainer.rewards`` is imported (the package imports ``rule_based``, which imports this module —
never the other way round)."""


def register_reward(*names: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register a reward function under one or more names (a duplicate name raises)."""
    return REWARD_REGISTRY.register(*names)


def get_reward_fn(name_or_path: str | RewardFn) -> RewardFn:
    """Resolve a reward function.

    Args:
        name_or_path: A registered name (``"math"``, ``"math_exact"``, ``"format"``, ...), or
            ``"package.module:function"`` (imported), or ``"path/to/file.py:function"`` (loaded from the
            file, like verl's ``custom_reward_function.path``), or a callable (returned as is).

    Returns:
        The function.

    Raises:
        ValueError: Unknown name (the message lists the registered ones), a module, file or attribute that
            does not exist (``utils.registry.load_object``), or an attribute that is not callable.

    """
    if callable(name_or_path):
        return check_reward_signature(name_or_path, repr(name_or_path))
    if not isinstance(name_or_path, str):
        raise TypeError(
            f"reward function must be a name, 'module:function' or a callable, got {name_or_path!r}"
        )
    fn = REWARD_REGISTRY.resolve(name_or_path)  # a name, "module:function" or "file.py:function"
    if not callable(fn):
        raise ValueError(f"reward function {name_or_path!r} is a {type(fn).__name__}, not a callable")
    return check_reward_signature(fn, name_or_path)


def check_reward_signature(fn: RewardFn, name: str) -> RewardFn:
    """``fn`` itself when it has verl's or TRL's signature (see :func:`reward_style`).

    Raises:
        ValueError: It has neither (the message shows its signature and both expected ones).
    """
    reward_style(fn, name)
    return fn


def available_rewards() -> list[str]:
    """The registered reward names."""
    return [str(k) for k in REWARD_REGISTRY.keys()]
