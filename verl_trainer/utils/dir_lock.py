"""An exclusive lock on a directory for the length of a run: :class:`DirectoryLock`.

Two runs writing checkpoints into one directory corrupt each other (one prunes or commits over the
other's half-written step). A run therefore holds ``<dir>/.verl_trainer.lock`` for its whole fit: an
``fcntl.flock`` on the file, which the kernel releases when the process ends however it ends, so a killed
run never blocks the next one. The file records who holds it (pid, host, run id, start time); a second
run is refused with :class:`DirectoryLockedError` naming the holder, and a run that takes over the lock of
a process that died without releasing it reports that stale lock (:attr:`DirectoryLock.stale`).

Within one process the lock is re-entrant: a recipe checks it before its first step
(:meth:`DirectoryLock.ensure_free`, which writes nothing, so a second run is refused before it writes or
loads anything and a run whose model is missing fails with nothing written), takes it once its model is
resolved, and the fit's ``ModelCheckpoint`` takes it again; only the outermost holder's
:meth:`DirectoryLock.release` gives it up.

``flock`` is local to one machine's kernel; on a network file system shared by several hosts it may not
exclude a run on another host (the holder's host is recorded, so the message names it).
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Any

__all__ = ["LOCK_FILE", "DirectoryLock", "DirectoryLockedError", "describe_holder"]

LOCK_FILE = ".verl_trainer.lock"
_HELD: dict[str, DirectoryLock] = {}  # lock file (resolved) -> the outermost holder in this process


class DirectoryLockedError(FileExistsError):
    """The directory is locked by another running process."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def describe_holder(holder: dict[str, Any]) -> str:
    """``pid 123 on host h (run id abc, since 2026-12-03T10:00:00Z)`` for messages."""
    text = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"
    extra = [f"run id {holder['run_id']}" if holder.get("run_id") else "",
             f"since {holder['started']}" if holder.get("started") else ""]
    extra = [e for e in extra if e]
    return text + (f" ({', '.join(extra)})" if extra else "")


def _read(fd: int) -> dict[str, Any] | None:
    os.lseek(fd, 0, os.SEEK_SET)
    data = b""
    while chunk := os.read(fd, 4096):
        data += chunk
    try:
        holder = json.loads(data.decode())
    except (UnicodeDecodeError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


class DirectoryLock:
    """Hold ``<directory>/.verl_trainer.lock`` exclusively until :meth:`release` (or the process ends).

    Args:
        directory: The directory to lock (created if missing).
        what: How the directory is named in messages (``"checkpoint directory"``).
        run_id: Recorded in the lock file for the message another run gets.

    Attributes:
        stale: What the lock file recorded when it was taken over from a process that ended without
            releasing it (``None``: the lock was free). For a message.
    """

    def __init__(self, directory: str | os.PathLike, what: str = "directory", run_id: str | None = None
                 ) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self.what = what
        self.run_id = run_id
        self.stale: dict[str, Any] | None = None
        self._fd: int | None = None
        self._nested = False

    def acquire(self) -> DirectoryLock:
        """Take the lock or raise.

        Raises:
            DirectoryLockedError: If another process holds it, naming that process and the fix.
        """
        if self.held:
            return self
        self.directory.mkdir(parents=True, exist_ok=True)
        key = str(self.path.resolve())
        if key in _HELD:  # this process holds it already (the outer holder releases it)
            self._nested = True
            return self
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd) or {}
                os.close(fd)
                raise self._locked_error(holder) from None
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:  # not a file a releasing holder unlinked between our open and our lock
                break
            os.close(fd)
        previous = _read(fd)
        if previous and previous.get("pid") is not None:
            self.stale = {**previous, "alive": previous.get("host") == socket.gethostname()
                          and _alive(int(previous["pid"]))}
        record = {"pid": os.getpid(), "host": socket.gethostname(), "run_id": self.run_id,
                  "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(record).encode())
        os.fsync(fd)
        self._fd = fd
        _HELD[key] = self
        return self

    def ensure_free(self) -> None:
        """Raise if another process holds the lock now; creates and writes nothing (a check, not a claim).

        For a run that must be refused before its first write but cannot take the lock yet (taking it
        creates the directory). :meth:`acquire` still decides: a run that starts in between is refused there.

        Raises:
            DirectoryLockedError: If another process holds it, naming that process and the fix.
        """
        if self.held or str(self.path.resolve()) in _HELD:
            return
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self._locked_error(_read(fd) or {}) from None
        finally:
            os.close(fd)  # releases the probe's flock, if it got one

    def _locked_error(self, holder: dict[str, Any]) -> DirectoryLockedError:
        return DirectoryLockedError(
            f"{self.what} {str(self.directory)!r} is in use by another run ({describe_holder(holder)}); two "
            f"runs in one directory overwrite each other's checkpoints. Wait for that run to end, or give "
            f"this run another directory (default_root_dir, or ModelCheckpoint(dirpath=...))")

    def stale_message(self) -> str | None:
        """A line about the stale lock this run took over, or ``None``."""
        if self.stale is None:
            return None
        state = "still running, but no longer holding it" if self.stale.get("alive") else "no longer running"
        return (f"{self.what} {str(self.directory)!r}: took over a stale lock left by "
                f"{describe_holder(self.stale)}, {state}; its half-written checkpoints are removed")

    def release(self) -> None:
        """Give the lock up (the file is emptied and removed); a no-op when not held, or held nested."""
        if self._nested:
            self._nested = False
            return
        if self._fd is None:
            return
        _HELD.pop(str(self.path.resolve()), None)
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
            self.path.unlink(missing_ok=True)
        finally:
            os.close(fd)  # releases the flock

    @property
    def held(self) -> bool:
        """Whether this object holds the lock (itself, or inside an outer holder of this process)."""
        return self._fd is not None or self._nested

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
