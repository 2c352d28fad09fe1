"""The two reward-function signatures a user may write, told apart from the signature alone.

* **verl** (``compute_score``), one sample per call::

      def f(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

* **TRL** (``GRPOTrainer`` reward functions), the whole batch per call, dataset columns by name::

      def f(prompts, completions, **kwargs) -> list[float | None]

  ``kwargs`` holds ``ground_truth``, ``data_source``, ``extra_info`` and every other column of the prompt
  file, one list entry per sample. As in TRL, ``prompts``/``completions`` are strings, or chat messages
  (``completions[i] = [{"role": "assistant", "content": ...}]``) when the prompts are chat lists; ``None``
  means "does not apply to this sample" (it counts 0 in the weighted sum and is left out of the function's
  mean).

A function is TRL-style when it takes a parameter named ``completions`` (its other named parameters are
columns; a column the prompt file lacks is an error at the first call, naming it); otherwise it must accept
verl's three positional arguments. :func:`reward_style` decides when the config is loaded, so a function with
neither signature fails before any model loads.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["TRL", "VERL", "reward_style"]

VERL = "verl"
TRL = "trl"


def reward_style(fn: Callable[..., Any], name: str) -> str:
    """``"trl"`` or ``"verl"``: how ``fn`` is called (see the module docstring).

    Raises:
        ValueError: ``fn`` fits neither signature; the message shows its signature and both expected ones.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: called verl's way
        return VERL
    params = signature.parameters
    if "completions" in params:
        # called with keywords only; its other named parameters are columns, checked at the first call
        if not any(p.kind is inspect.Parameter.POSITIONAL_ONLY for p in params.values()):
            return TRL
    else:
        try:
            signature.bind("data_source", "solution_str", "ground_truth")
            return VERL
        except TypeError:
            pass
    raise ValueError(
        f"reward function {name} has the signature {signature}, which is neither verl's "
        "compute_score(data_source, solution_str, ground_truth, extra_info=None) nor TRL's "
        "f(prompts, completions, **kwargs) -> list[float] (kwargs: ground_truth, data_source, extra_info and "
        "the prompt file's other columns); write it with one of them"
    )
