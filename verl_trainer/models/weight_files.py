"""Checking a model's safetensors files before anything loads them: :func:`check_safetensors`.

A truncated or damaged ``model.safetensors`` (an interrupted copy or download) makes ``from_pretrained``
fail deep inside the safetensors reader with a message that names no file ("incomplete metadata, file
not fully covered"). A safetensors file is an 8-byte little-endian header length, a JSON header giving
every tensor's byte range, then the data; :func:`check_safetensors` reads only the header and compares
the file's size with the end of the last tensor, so a damaged file is named in milliseconds, before any
model is built.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

__all__ = ["DamagedWeightsError", "check_safetensors", "check_weight_dir"]

MAX_HEADER = 100 << 20  # the format's own limit is 100 MB


class DamagedWeightsError(ValueError):
    """A weights file is truncated or is not a safetensors file."""


def _damaged(path: Path, why: str) -> DamagedWeightsError:
    return DamagedWeightsError(
        f"model weights file {str(path)!r} is damaged: {why}. Copy, download or export the model again "
        f"(the file is probably truncated by an interrupted copy)"
    )


def check_safetensors(path: str | os.PathLike) -> dict[str, dict]:
    """Read ``path``'s header and check the file holds every tensor it lists.

    Returns:
        The header (``{name: {"dtype", "shape", "data_offsets"}}``, without ``__metadata__``).

    Raises:
        DamagedWeightsError: Naming the file, what is wrong and the fix.
    """
    file = Path(path)
    size = file.stat().st_size
    with file.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise _damaged(file, f"it has {size} bytes, fewer than a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER, size - 8):
            raise _damaged(file, f"its header claims {length} bytes but the file has {size}")
        raw = handle.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise _damaged(file, f"its header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _damaged(file, "its header is not a JSON object")
    header.pop("__metadata__", None)
    try:
        end = max((int(entry["data_offsets"][1]) for entry in header.values()), default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        raise _damaged(file, "its header has a tensor without valid data_offsets") from None
    expected = 8 + length + end
    if size < expected:
        raise _damaged(file, f"it has {size} bytes but its tensors end at byte {expected} "
                             f"({expected - size} bytes missing)")
    return header


def check_weight_dir(directory: str | os.PathLike) -> None:
    """:func:`check_safetensors` on every ``*.safetensors`` file directly in ``directory``."""
    for file in sorted(Path(directory).glob("*.safetensors")):
        check_safetensors(file)
