"""A booby-trapped object for the checkpoint-safety tests: unpickling it creates a file."""

from __future__ import annotations

from pathlib import Path


class Trap:
    """Unpickling it creates the file ``path`` (standing in for any code an attacker would run)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple:
        return (open, (self.path, "w"))
