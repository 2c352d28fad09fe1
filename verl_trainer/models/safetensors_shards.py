"""Writing a stream of ``(name, tensor)`` pairs as HF safetensors files, one shard in memory at a time.

A model is written as ``model.safetensors`` when it fits in one shard, otherwise as
``model-00001-of-0000N.safetensors`` … plus ``model.safetensors.index.json`` (``metadata.total_size`` and
the ``weight_map``), the layout ``save_pretrained`` writes and ``from_pretrained`` reads. Tensors arrive
one at a time (gathered from shards by the engine, or read from a checkpoint); :class:`SafetensorsShardWriter`
keeps only the current shard's tensors (what ``safetensors.torch.save_file`` needs at once), writes a shard
as soon as the next tensor would make it larger than ``max_shard_size``, and names the files when the last
one is written (the number of shards is known only then).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from verl_trainer.models.hf_files import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

__all__ = ["SafetensorsShardWriter", "parse_size"]

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes of ``size``: an int, or a number with a unit, as ``save_pretrained`` takes (``"5GB"``).

    Raises:
        ValueError: Naming the value and the accepted forms.
    """
    if isinstance(size, int) and not isinstance(size, bool):
        if size < 1:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    text = str(size).strip().upper().replace(" ", "")
    digits = text.rstrip("BKMGTI")
    unit = text[len(digits):] or "B"
    try:
        value = float(digits) * _UNITS[unit]
    except (KeyError, ValueError):
        raise ValueError(
            f"max_shard_size={size!r} is not a size; use bytes (an int) or a number with one of the units "
            f"{sorted(_UNITS)} (e.g. '5GB', '500MiB')"
        ) from None
    if value < 1:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return int(value)


class SafetensorsShardWriter:
    """Collect tensors into shards of at most ``max_shard_size`` bytes and write them into ``directory``.

    A tensor larger than ``max_shard_size`` gets a shard of its own (as in ``save_pretrained``).

    Args:
        directory: An existing directory.
        max_shard_size: Bytes per shard, or a string like ``"5GB"`` (:func:`parse_size`).
        dtype: Cast floating-point tensors to this dtype (``None``: keep each tensor's dtype).

    Example::

        writer = SafetensorsShardWriter(out, "2GB")
        for name, tensor in named_tensors:
            writer.add(name, tensor)
        files = writer.finish()
    """

    def __init__(self, directory: str | os.PathLike, max_shard_size: int | str = "5GB",
                 dtype: torch.dtype | None = None) -> None:
        self.directory = Path(directory)
        self.max_shard_size = parse_size(max_shard_size)
        self.dtype = dtype
        self._current: dict[str, torch.Tensor] = {}
        self._current_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []  # (temporary file, names in it)
        self.total_size = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` to CPU (own storage) into the current shard; write the shard first when full.

        Raises:
            ValueError: If ``name`` was added before.
        """
        if name in self._current or any(name in names for _, names in self._written):
            raise ValueError(f"tensor {name!r} was added twice")
        dtype = self.dtype if self.dtype is not None and tensor.is_floating_point() else tensor.dtype
        # one copy: on CPU, contiguous, its own storage (safetensors refuses tensors that share memory)
        value = tensor.detach().to(device="cpu", dtype=dtype, copy=True,
                                   memory_format=torch.contiguous_format)
        nbytes = value.numel() * value.element_size()
        if self._current and self._current_bytes + nbytes > self.max_shard_size:
            self._flush()
        self._current[name] = value
        self._current_bytes += nbytes
        self.total_size += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.directory / f".shard-{len(self._written):05d}.safetensors.tmp"
        save_file(self._current, str(path), metadata={"format": "pt"})
        self._written.append((path, list(self._current)))
        self._current, self._current_bytes = {}, 0

    def finish(self) -> list[str]:
        """Write the last shard, give the files their final names, write the index when sharded.

        Returns:
            The weight file names written (``["model.safetensors"]`` or the ``model-0000i-of-0000N`` ones).

        Raises:
            ValueError: If no tensor was added.
        """
        if self._current:
            self._flush()
        if not self._written:
            raise ValueError(f"no tensors to write into {str(self.directory)!r}")
        count = len(self._written)
        if count == 1:
            names = [SAFE_WEIGHTS_NAME]
        else:
            names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        weight_map: dict[str, str] = {}
        for (tmp, tensors), name in zip(self._written, names):
            tmp.rename(self.directory / name)
            weight_map.update(dict.fromkeys(tensors, name))
        if count > 1:
            index = {"metadata": {"total_size": self.total_size},
                     "weight_map": dict(sorted(weight_map.items()))}
            (self.directory / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return names
