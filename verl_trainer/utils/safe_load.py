"""Loading files someone else may have written without running their code.

Every file the project reads back from a checkpoint goes through :func:`safe_torch_load`
(``torch.load(weights_only=True)``: tensors and plain data, plus the classes a caller names) or through a
:class:`RestrictedUnpickler` that only resolves an explicit allow-list of globals. A file holding anything
else (a class with ``__reduce__``, a function, a module) fails with :class:`UnsafeCheckpointError`, naming
the file, before any of its objects is built; a truncated or otherwise unreadable file fails the same way.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.serialization import MAP_LOCATION

__all__ = ["RestrictedUnpickler", "UnsafeCheckpointError", "refusal", "safe_torch_load"]


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file holds something other than tensors and plain data, or cannot be read."""


def refusal(path: str | os.PathLike, detail: str) -> UnsafeCheckpointError:
    """The error for a file that was not loaded: which file, why, and what to do."""
    return UnsafeCheckpointError(
        f"refusing to load {str(path)!r}: {detail}. Checkpoint files may hold tensors and plain data only, "
        f"so this file was not written by verl-trainer or was changed or damaged since; nothing in it was "
        f"run. Resume from another checkpoint, or restore this one from a copy you trust"
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    for line in text.splitlines():
        if "Unsupported global" in line or "Unsupported operand" in line:
            return line.strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def safe_torch_load(
    path: str | os.PathLike | IO[bytes],
    safe_globals: Iterable[Any] = (),
    name: str | None = None,
    map_location: MAP_LOCATION = "cpu",
) -> Any:
    """``torch.load(path, weights_only=True)`` with errors that name the file.

    Args:
        path: The file (or an open binary file object; then pass ``name``).
        safe_globals: Extra classes the file may contain (``torch.serialization.safe_globals``).
        name: How to name the file in errors (default: ``path``).
        map_location: As for ``torch.load``.

    Returns:
        The loaded object.

    Raises:
        UnsafeCheckpointError: If the file holds a class or function outside the allow-list, or is
            truncated or corrupted.
        FileNotFoundError: If ``path`` does not exist.
    """
    label = name if name is not None else str(path)
    if isinstance(path, (str, os.PathLike)) and not Path(path).is_file():
        raise FileNotFoundError(f"checkpoint file {label!r} is missing")
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(path, weights_only=True, map_location=map_location)
    except pickle.UnpicklingError as exc:
        raise refusal(label, _first_line(exc)) from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:  # truncated zip, bad magic, ...
        raise refusal(label, f"it is not a readable torch file ({_first_line(exc)})") from None


class RestrictedUnpickler(pickle.Unpickler):
    """A ``pickle.Unpickler`` whose globals come only from an allow-list.

    Args:
        file: The open binary file.
        allowed: ``(module, name) -> object`` for every global the file may reference.
        extra: A predicate for further ``(module, name)`` pairs, resolved with ``getattr`` on the module
            (used for families such as ``torch.float32``, checked on the resolved object).
        label: How to name the file in errors.
    """

    def __init__(
        self,
        file: IO[bytes],
        allowed: dict[tuple[str, str], Any],
        label: str,
        extra: Callable[[str, str], Any | None] | None = None,
    ) -> None:
        super().__init__(file)
        self._allowed, self._extra, self._label = allowed, extra, label

    def find_class(self, module: str, name: str) -> Any:
        """Resolve an allowed global; refuse every other one."""
        if (module, name) in self._allowed:
            return self._allowed[(module, name)]
        found = self._extra(module, name) if self._extra is not None else None
        if found is not None:
            return found
        raise refusal(self._label, f"it references {module}.{name}, which is not on the allow-list")

    def persistent_load(self, pid: Any) -> Any:
        """Refuse persistent ids (plain pickles of metadata have none)."""
        raise refusal(self._label, f"it uses a persistent id ({str(pid)[:40]!r})")

    def load_checked(self) -> Any:
        """``load()`` with truncated or malformed data reported as :class:`UnsafeCheckpointError`."""
        try:
            return self.load()
        except UnsafeCheckpointError:
            raise
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
                KeyError) as exc:
            raise refusal(self._label, f"it is not a readable pickle ({type(exc).__name__}: {exc})") from None
