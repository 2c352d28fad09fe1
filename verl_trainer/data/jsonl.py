"""Reading JSON Lines (and JSON array) files with errors that name the file and the line.

A line that is not valid JSON, not an object, or not UTF-8 fails at load time with
``<file>:<line>: <what is wrong>`` and the fix, instead of a bare ``JSONDecodeError`` /
``UnicodeDecodeError`` without a location.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["read_json_rows"]


def _decode(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ValueError(
            f"{path}:{line}: byte {raw[exc.start]:#04x} at column {column} is not UTF-8; save the file as "
            f"UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None


def _row(value: Any, path: Path, line: int) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{path}:{line}: expected a JSON object (one row), got {type(value).__name__}")
    return value


def read_json_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``.jsonl`` file (one JSON object a line; blank lines skipped) or a ``.json`` array.

    Raises:
        ValueError: Naming the file and line of invalid JSON, a non-object row, or a non-UTF-8 byte.
    """
    file = Path(path)
    text = _decode(file)
    if file.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{file}:{exc.lineno}: invalid JSON ({exc.msg}, column {exc.colno})") from None
        return [_row(v, file, i + 1) for i, v in enumerate(values)]
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{file}:{number}: invalid JSON ({exc.msg}, column {exc.colno}); each line of a .jsonl "
                f"file must be one complete JSON object"
            ) from None
        rows.append(_row(value, file, number))
    return rows
