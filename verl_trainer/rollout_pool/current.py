"""This process's rollout pool, where the launch split its world (``placement=separate``).

Set once by :func:`~verl_trainer.rollout_pool.world.split_world`; read by the Trainer, the pool's stage,
callbacks that must reach the rollout ranks (``RayTrainReport``) and the recipes (a rollout rank's script
ends after ``fit``). A module of its own so that readers below the module layer need not import the pool.
"""

from __future__ import annotations

from typing import Any

__all__ = ["current_pool", "is_rollout_rank", "set_current_pool"]

_CURRENT: Any = None


def set_current_pool(pool: Any) -> Any:
    """Make ``pool`` (a ``world.Pool`` or ``None``) this process's pool; returns it."""
    global _CURRENT
    _CURRENT = pool
    return pool


def current_pool() -> Any:
    """This process's ``world.Pool`` (``None``: colocated, or not launched by the Trainer)."""
    return _CURRENT


def is_rollout_rank() -> bool:
    """Whether this process is a rollout rank of a separate pool.

    Its ``fit`` returned ``None``; a script's later stages (validation, export) belong to the trainer ranks.
    """
    return _CURRENT is not None and _CURRENT.serves_rollout
