"""Decoding a prompt row's images: bytes, paths, ``{"bytes", "path"}`` dicts or PIL images, to RGB PIL images.

Both multimodal layouts store images in one column per row (:func:`row_images`):

* verl's: ``images``, a list of ``{"bytes": ..., "path": ...}`` dicts (the ``datasets`` ``Image`` feature
  as parquet stores it) or of paths;
* TRL's: ``image`` (one image) or ``images`` (a list), PIL images in a ``datasets.Dataset`` or the same
  dicts / paths in a file.

Every image is decoded once, here, to an RGB ``PIL.Image.Image``; resizing is the image processor's
(:mod:`verl_trainer.data.vlm_processor`). A missing file or undecodable bytes raise :class:`ImageError`
naming the row, the image and the cause.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from PIL import Image

__all__ = ["IMAGE_KEYS", "VIDEO_KEYS", "ImageError", "image_column", "load_image", "load_images",
           "refuse_videos", "row_images"]

IMAGE_KEYS = ("images", "image")
"""The image columns looked for, in order: verl's / TRL's ``images`` (a list), TRL's ``image`` (one)."""


VIDEO_KEYS = ("videos", "video")
"""Video columns (verl's and TRL's names), refused: only images are read (:func:`refuse_videos`)."""


class ImageError(ValueError):
    """An image of a row that cannot be read (a missing file, bytes that do not decode, no image at all).

    The message names the row, the image's position and the path or the decode error.
    """


def _file(path: str | os.PathLike, where: str) -> Image.Image:
    text = str(path)
    text = text[len("file://"):] if text.startswith("file://") else text
    file = Path(text).expanduser()
    if not file.is_file():
        raise ImageError(f"{where}: image file {text!r} does not exist (relative paths are read from the "
                         f"working directory {os.getcwd()!r}); fix the path or store the image's bytes")
    try:
        return Image.open(file)
    except Exception as exc:  # noqa: BLE001  (PIL raises several kinds; all mean the file is no image)
        raise ImageError(f"{where}: cannot decode image file {text!r} ({type(exc).__name__}: {exc})"
                         ) from None


def _bytes(data: bytes, where: str) -> Image.Image:
    try:
        return Image.open(io.BytesIO(data))
    except Exception as exc:  # noqa: BLE001
        raise ImageError(f"{where}: cannot decode the image's {len(data)} bytes ({type(exc).__name__}: "
                         f"{exc}); store PNG/JPEG bytes or a path") from None


def load_image(value: Any, where: str = "image") -> Image.Image:
    """One image as an RGB PIL image, fully decoded.

    Args:
        value: A ``PIL.Image.Image``; ``bytes``; a path (``str`` / ``PathLike``, ``file://`` allowed); or a
            mapping with ``"image"`` (any of these: qwen-vl-utils' form), ``"bytes"`` (used when not ``None``)
            or ``"path"``.
        where: What the messages call the image (e.g. ``"prompt row 3, image 0"``).

    Raises:
        ImageError: Missing file, undecodable data or a value of none of these kinds.
    """
    if isinstance(value, Image.Image):
        image = value
    elif isinstance(value, (bytes, bytearray, memoryview)):
        image = _bytes(bytes(value), where)
    elif isinstance(value, (str, os.PathLike)):
        image = _file(value, where)
    elif isinstance(value, Mapping) and value.get("image") is not None:  # qwen-vl-utils' {"image": ...}
        return load_image(value["image"], where)
    elif isinstance(value, Mapping) and (value.get("bytes") is not None or value.get("path")):
        image = _bytes(bytes(value["bytes"]), where) if value.get("bytes") is not None else _file(
            value["path"], where)
    else:
        shown = {k: type(v).__name__ for k, v in value.items()} if isinstance(value, Mapping) else value
        raise ImageError(f"{where}: {str(shown)[:80]!r} is no image; give a PIL image, bytes, a path, or a "
                         "{'bytes': ..., 'path': ...} dict with one of them set")
    try:
        image.load()
        return image if image.mode == "RGB" else image.convert("RGB")
    except Exception as exc:  # noqa: BLE001  (truncated data is found on load)
        raise ImageError(f"{where}: cannot decode the image ({type(exc).__name__}: {exc})") from None


def image_column(row: Mapping[str, Any], image_key: str | None = None) -> str | None:
    """The row's image column, ``None`` when it has none.

    ``image_key`` when given, else the first of :data:`IMAGE_KEYS` present and not ``None``.
    """
    if image_key is not None:
        return image_key if row.get(image_key) is not None else None
    return next((k for k in IMAGE_KEYS if row.get(k) is not None), None)


def row_images(row: Mapping[str, Any], image_key: str | None = None) -> list[Any]:
    """The row's images as stored (not decoded): a list, ``[]`` without an image column.

    A single value (TRL's ``image``; a lone dict, path or PIL image) becomes a one-element list.
    """
    key = image_column(row, image_key)
    if key is None:
        return []
    value = row[key]
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)):
        return list(value)
    if hasattr(value, "tolist") and not isinstance(value, Image.Image):  # a numpy object array (pandas)
        return list(value.tolist())
    return [value]


def refuse_videos(row: Mapping[str, Any], where: str) -> None:
    """Fail on a non-empty video column: videos are not read, so the row's videos would be silently lost.

    Raises:
        ImageError: Naming the row and the column.
    """
    for key in VIDEO_KEYS:
        value = row.get(key)
        if value is not None and not (hasattr(value, "__len__") and len(value) == 0):
            raise ImageError(f"{where} has a {key!r} column: videos are not supported (only images: the "
                             f"{IMAGE_KEYS} columns); drop the column or give frames as images")


def load_images(values: Sequence[Any], where: str) -> list[Image.Image]:
    """:func:`load_image` of each value; the messages say ``"{where}, image {j}"``."""
    return [load_image(v, f"{where}, image {j}") for j, v in enumerate(values)]
