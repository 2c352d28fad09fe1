"""A write that failed because the disk is full says so, naming the path: :func:`disk_full_error`.

A full disk shows up as ``OSError(ENOSPC)`` from Python writes, but torch's own file writer
(``torch.save``) reports it as ``RuntimeError: [enforce fail at inline_container.cc:...] unexpected pos``,
which names neither the cause nor the file. :func:`disk_full_error` turns both into
:class:`DiskFullError` (an ``OSError`` with ``errno.ENOSPC``): "no space left on <path>", with the free
space of that file system and the fix.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

__all__ = ["FULL_BELOW_BYTES", "DiskFullError", "disk_full_error"]

FULL_BELOW_BYTES = 1 << 20
"""A torch writer error counts as a full disk when its file system has less than this free."""
_TORCH_WRITER = ("inline_container", "PytorchStreamWriter")


class DiskFullError(OSError):
    """No space left on the file system of the path being written."""


def _free(path: Path) -> int | None:
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def disk_full_error(exc: BaseException, path: str | os.PathLike, what: str = "the output"
                    ) -> DiskFullError | None:
    """A :class:`DiskFullError` for ``exc`` when it is a full disk, else ``None``.

    Call it before the failed write's files are removed (a torch writer error is recognised by the free
    space left on the file system).

    Args:
        exc: The exception the write raised.
        path: What was being written (named in the message).
        what: How to name it (``"checkpoint"``, ``"HF export"``).
    """
    if isinstance(exc, DiskFullError):
        return exc
    free = _free(Path(path))
    full_errno = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1))
    torch_writer = isinstance(exc, RuntimeError) and any(t in str(exc) for t in _TORCH_WRITER)
    if not full_errno and not (torch_writer and free is not None and free < FULL_BELOW_BYTES):
        return None
    left = f"{free} bytes free" if free is not None else "free space unknown"
    return DiskFullError(
        errno.ENOSPC,
        f"no space left on {os.fspath(path)} while writing {what} ({left} there; the half-written files are "
        f"removed). Free some space or write to another file system, then run again",
    )
