"""One registry helper for every swappable part (policy losses, advantage estimators, rewards, ...).

A :class:`Registry` maps a name to an object and behaves as a dict (verl's registries are dicts, so
code written against them runs here). Registering a name twice raises with a hint; looking up a missing
name raises :class:`UnknownKeyError` (both a ``KeyError`` and a ``ValueError``) listing what exists.
The engine registry keys on a tuple (model_type, backend, device, vendor) and builds on the same class.

Configs name a part by its registered name or by where it is defined: ``"package.module:name"``
(imported) or ``"path/to/file.py:name"`` (the file loaded once per run), the same for rewards, policy
losses, advantage estimators and callbacks (:func:`load_object`, :meth:`Registry.resolve`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Hashable, Iterable, Iterator, MutableMapping
from pathlib import Path
from types import ModuleType
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class UnknownKeyError(KeyError, ValueError):
    """A key that is not registered: a ``KeyError`` for mapping code, a ``ValueError`` for config errors."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


_MISSING: Any = object()


class Registry(MutableMapping[Hashable, T], Generic[T]):
    """A named mapping from keys to registered objects.

    It behaves as a dict (``in``, ``[]``, iteration, ``len``, ``del``, ``clear``), except that registering
    a taken key raises.

    Args:
        kind: What is registered, used in error messages (e.g. ``"policy loss"``).
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[Hashable, T] = {}

    def add(self, key: Hashable, obj: T) -> T:
        """Register ``obj`` under ``key``; another object under a taken key raises ``ValueError``.

        Registering the same object again under its key changes nothing (as verl's registries allow:
        a module imported twice registers its functions twice).
        """
        if key in self._entries and self._entries[key] is not obj:
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

    def __getitem__(self, key: Hashable) -> T:
        try:
            return self._entries[key]
        except (KeyError, TypeError):
            raise UnknownKeyError(
                f"unknown {self.kind} {key!r}; registered: {self.keys_repr()}. "
                f"Use one of these or register your own."
            ) from None

    def __setitem__(self, key: Hashable, obj: T) -> None:
        self.add(key, obj)

    def __delitem__(self, key: Hashable) -> None:
        del self._entries[key]

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        try:
            return key in self._entries
        except TypeError:
            return False

    def get(self, key: Hashable, default: Any = _MISSING) -> Any:
        """The object under ``key``.

        A miss returns ``default`` when one is given, else raises :class:`UnknownKeyError` (a
        ``ValueError``) listing the registered keys.
        """
        if default is not _MISSING:
            return self._entries.get(key, default)
        return self[key]

    def keys_repr(self) -> str:
        """The registered keys as a sorted, comma-separated string."""
        return keys_repr(self._entries)

    def resolve(self, key: Hashable) -> T:
        """The object under ``key``, or the one ``"module:name"`` / ``"file.py:name"`` names.

        See :func:`load_object`.

        Raises:
            UnknownKeyError: An unknown registered name (listing the registered ones).
            ValueError: A module, file or attribute that does not exist.
        """
        if is_object_path(key):
            return load_object(str(key), self.kind)
        return self[key]

    def remove(self, key: Hashable) -> T:
        """Unregister ``key`` (for tests and plugins); returns the removed object."""
        return self._entries.pop(key)


def keys_repr(mapping: Iterable[Hashable]) -> str:
    """The keys of a registry or a plain dict as a sorted, comma-separated string."""
    return ", ".join(sorted(repr(k) for k in mapping)) or "(none)"


def rebound(original: Any, attr: str, *modules: str) -> Any:
    """The object now bound to ``attr``: the first of ``modules`` that rebinds it, else ``original``.

    verl's registries are module-level dicts that code (verl's own tests among it) may replace
    (``core_algos.ADV_ESTIMATOR_REGISTRY = {...}``); a registry function that looks its registry up
    through this sees the replacement, as verl's functions do.

    Args:
        original: The object the modules were created with.
        attr: The module attribute's name.
        modules: Names of modules (in ``sys.modules``) that expose ``attr``.
    """
    for name in modules:
        bound = getattr(sys.modules.get(name), attr, original)
        if bound is not original:
            return bound
    return original


def as_list(value: str | Iterable[str] | None) -> list[str | None]:
    """Normalise a string, an iterable of strings, or ``None`` to a list."""
    if value is None or isinstance(value, str):
        return [value]
    return list(value)


_FILE_MODULES: dict[Path, ModuleType] = {}


def is_object_path(key: object) -> bool:
    """Whether ``key`` names an object by where it is defined (``"module:name"``, ``"file.py:name"``)."""
    return isinstance(key, str) and ":" in key


def _module_from_file(path: Path, kind: str) -> ModuleType:
    """The module of a Python file, executed the first time it is asked for (later: the same module)."""
    path = path.resolve()
    if path in _FILE_MODULES:
        return _FILE_MODULES[path]
    name = f"_verl_trainer_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{kind} file {str(path)!r}: cannot import it as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up there
    if str(path.parent) not in sys.path:  # `import helpers` of a sibling helpers.py works, as in a script
        sys.path.append(str(path.parent))  # appended: an installed module of the same name wins
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    _FILE_MODULES[path] = module
    return module


def load_object(spec: str, kind: str) -> Any:
    """The object ``spec`` names: ``"package.module:name"`` (imported) or ``"path/to/file.py:name"``.

    A file is loaded once per process (resolving it again returns the same objects, so a decorator in it
    registers once). ``name`` may be dotted (``"file.py:Class.method"``). The file's folder is appended to
    ``sys.path``, so the file may ``import`` its sibling modules (an installed module of the same name is
    found first: give siblings distinct names).

    Args:
        spec: ``"<module or file>:<name>"``.
        kind: What is loaded, for messages (``"reward function"``, ``"policy loss"``, ...).

    Raises:
        ValueError: A malformed spec, a module that cannot be imported, a file that does not exist, or a
            missing attribute; the message names the spec and the fix.
    """
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ValueError(f"{kind} {spec!r}: expected 'module.path:name' or 'path/to/file.py:name'")
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"{kind} file {target!r} does not exist (from {spec!r}); give an existing "
                             "file.py:name or package.module:name")
        module = _module_from_file(path, kind)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            raise ValueError(f"{kind} {spec!r}: cannot import module {target!r} ({err})") from err
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, _MISSING)
        if obj is _MISSING:
            raise ValueError(f"{kind} {spec!r}: module {target!r} has no attribute {attr!r}")
    return obj
