"""What a reward function returned, checked: a number per sample, or the function and the sample are named.

A verl-style ``compute_score`` returns, per sample, a number or a dict with a numeric ``"score"``; a TRL
function returns one number (or ``None``: "no score for this one") per completion. Anything else — ``None``
from a verl function, a list, a string such as ``"0.5"``, a tensor of several values — is refused, never
converted: the message names the reward function, the sample's index, its data source, the start of its
response and what was returned: a failed call of that sample (:mod:`verl_trainer.rewards.failures`,
``on_error``), or a :class:`RewardReturnError` when a TRL function's whole result has the wrong shape.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["RewardReturnError", "as_number", "as_score", "check_trl_output", "returned"]

_SHOWN = 60


class RewardReturnError(ValueError):
    """A reward function returned something that is not a score."""


def as_number(value: Any) -> float | None:
    """``value`` as a float when it is a real number (bool, int, float, numpy, 0-d tensor), else ``None``."""
    if isinstance(value, (torch.Tensor,)) and value.numel() == 1 and not value.is_complex():
        return float(value.item())
    if hasattr(value, "shape") and getattr(value, "shape", None) == () and hasattr(value, "item"):
        value = value.item()  # a 0-d numpy array
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def returned(value: Any) -> str:
    """``list [0.5]``: the type and the (cut) repr of a returned value, for messages."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= _SHOWN else text[:_SHOWN] + '…'}"


def as_score(result: Any, key: str | None = None) -> float:
    """The float score of one verl-style result (the number itself, or a dict's ``"score"``).

    Args:
        result: What the function returned (``key="score"``: the dict's entry).
        key: The dict key ``result`` came from, for the message.

    Raises:
        RewardReturnError: Naming the value (the caller's failure record names the function and sample).
    """
    value = as_number(result)
    if value is None:
        what = f"'{key}' " if key else ""
        raise RewardReturnError(f"returned {what}{returned(result)}; it must return a number (int, float, "
                                f"bool) or a dict with a numeric 'score'")
    return value


def check_trl_output(out: Any, name: str, count: int) -> list[Any]:
    """A TRL function's result as a list of ``count`` entries (each checked by the caller).

    Raises:
        RewardReturnError: Not a sequence, or not one entry per completion, naming the function.
    """
    if isinstance(out, torch.Tensor):
        out = out.tolist()
    if isinstance(out, (str, bytes)) or not isinstance(out, Sequence):
        raise RewardReturnError(f"reward function {name} (TRL signature) returned {returned(out)}; it must "
                                f"return a list of {count} numbers or None, one per completion")
    values = list(out)
    if len(values) != count:
        raise RewardReturnError(f"reward function {name} (TRL signature) returned {len(values)} values for "
                                f"{count} completions; it must return one number or None per completion")
    return values
