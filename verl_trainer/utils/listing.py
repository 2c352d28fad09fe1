"""Lists in messages: the first few items, then how many more (``a, b, c and 4 more``)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["first_of"]


def first_of(items: Sequence[str], limit: int, sep: str = ", ", total: int | None = None) -> str:
    """The first ``limit`` of ``items`` joined by ``sep``, then ``and N more`` if there were more.

    Args:
        items: What to list, in order.
        limit: How many to show.
        sep: The separator (``"; "`` for items that contain commas; it also goes before ``and N more``
            then).
        total: How many there were in all when ``items`` holds only some of them (default ``len(items)``).
    """
    total = len(items) if total is None else total
    more = total - min(len(items), limit)
    tail = "" if more <= 0 else (f" and {more} more" if sep == ", " else f"{sep}and {more} more")
    return sep.join(items[:limit]) + tail
