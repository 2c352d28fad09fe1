"""The Trainer's callback list: which callbacks run, and in which order.

``MetricReduction`` first, then the user's callbacks in the given order (the default ``ProgressBar`` after
them), and ``ModelCheckpoint`` callbacks last, as in Lightning.
"""

from __future__ import annotations

from collections.abc import Sequence

from verl_trainer.callbacks import Callback, MetricReduction, ModelCheckpoint, ProgressBar
from verl_trainer.callbacks.base import check_callback

__all__ = ["as_callback_list", "order_callbacks"]


def as_callback_list(callbacks: Sequence[Callback] | Callback | None) -> list[Callback]:
    """``callbacks`` (one, a sequence or ``None``) as a new list."""
    if callbacks is None:
        return []
    if isinstance(callbacks, Sequence) and not isinstance(callbacks, str):
        return list(callbacks)
    return [callbacks]


def order_callbacks(
    callbacks: Sequence[Callback] | Callback | None, progress_bar: bool, checkpointing: bool
) -> list[Callback]:
    """The checked callbacks in their fixed order, the default ones added.

    Raises:
        ValueError: A ProgressBar / ModelCheckpoint given while its ``enable_*`` flag is off, or two
            callbacks with one ``state_key``.
    """
    given = as_callback_list(callbacks)
    for cb in given:
        check_callback(cb)
    if any(isinstance(cb, ProgressBar) for cb in given) and not progress_bar:
        raise ValueError("a ProgressBar is in callbacks but enable_progress_bar=False; drop one of them")
    if any(isinstance(cb, ModelCheckpoint) for cb in given) and not checkpointing:
        raise ValueError("a ModelCheckpoint is in callbacks but enable_checkpointing=False; drop one of them")
    reduction = [cb for cb in given if isinstance(cb, MetricReduction)] or [MetricReduction()]
    checkpoints = [cb for cb in given if isinstance(cb, ModelCheckpoint)]
    if checkpointing and not checkpoints:
        checkpoints = [ModelCheckpoint()]
    middle = [cb for cb in given if not isinstance(cb, (MetricReduction, ModelCheckpoint))]
    if progress_bar and not any(isinstance(cb, ProgressBar) for cb in middle):
        middle.append(ProgressBar())
    ordered = reduction[:1] + middle + checkpoints
    keys = [cb.state_key for cb in ordered]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    if dupes:
        raise ValueError(f"callbacks share the state key(s) {dupes}; give each a distinct `state_key`")
    return ordered
