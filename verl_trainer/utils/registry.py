"""One registry helper for every swappable part (policy losses, advantage estimators, rewards, ...).

A :class:`Registry` maps a name to an object. Registering a name twice raises with a hint; looking up
a missing name raises ``ValueError`` listing what exists. The engine registry keys on a tuple
(model_type, backend, device, vendor) and builds on the same class.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named mapping from keys to registered objects.

    Args:
        kind: What is registered, used in error messages (e.g. ``"policy loss"``).
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[Hashable, T] = {}

    def add(self, key: Hashable, obj: T) -> T:
        """Register ``obj`` under ``key``; a duplicate key raises ``ValueError``."""
        if key in self._entries:
            raise ValueError(
                f"{self.kind} {key!r} is already registered (by {self._entries[key]!r}); "
                f"choose another name or remove the earlier registration."
            )
        self._entries[key] = obj
        return obj

    def register(self, *keys: Hashable) -> Callable[[T], T]:
        """Decorator form of :meth:`add`; several keys register the same object under each."""

        def deco(obj: T) -> T:
            for key in keys:
                self.add(key, obj)
            return obj

        return deco

    def get(self, key: Hashable) -> T:
        """Return the object registered under ``key``; a miss raises ``ValueError`` listing the keys."""
        try:
            return self._entries[key]
        except (KeyError, TypeError):
            raise ValueError(
                f"unknown {self.kind} {key!r}; registered: {self.keys_repr()}. "
                f"Use one of these or register your own."
            ) from None

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> list[Hashable]:
        """All registered keys, in registration order."""
        return list(self._entries)

    def items(self) -> Iterable[tuple[Hashable, T]]:
        """(key, object) pairs in registration order."""
        return self._entries.items()

    def keys_repr(self) -> str:
        """The registered keys as a sorted, comma-separated string."""
        return ", ".join(sorted(repr(k) for k in self._entries)) or "(none)"

    def remove(self, key: Hashable) -> Any:
        """Unregister ``key`` (for tests and plugins); returns the removed object."""
        return self._entries.pop(key)


def as_list(value: str | Iterable[str] | None) -> list[str | None]:
    """Normalise a string, an iterable of strings, or ``None`` to a list."""
    if value is None or isinstance(value, str):
        return [value]
    return list(value)
