"""verl-trainer: a Lightning-style trainer for LLM post-training with verl's engine.

Public names: :class:`Trainer`, :class:`EngineRegistry`, ``__version__``. Heavy submodules load lazily.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["EngineRegistry", "Trainer", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "EngineRegistry":
        from verl_trainer.engine import EngineRegistry  # lazy: the package's lazy export

        return EngineRegistry
    if name == "Trainer":
        from verl_trainer.trainer import Trainer  # lazy: the package's lazy export

        return Trainer
    raise AttributeError(f"module 'verl_trainer' has no attribute {name!r}")
