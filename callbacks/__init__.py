"""Callbacks for :class:`verl_trainer.Trainer`, installed as ``verl_trainer.callbacks``.

The folder sits at the repository root and is mapped onto ``verl_trainer.callbacks`` by setup.py.
"""

from verl_trainer.callbacks.base import Callback

__all__ = ["Callback"]
