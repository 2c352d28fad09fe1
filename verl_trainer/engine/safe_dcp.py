"""Loading torch.distributed.checkpoint (DCP) directories without unpickling arbitrary objects.

torch's ``FileSystemReader`` reads a checkpoint's ``.metadata`` with plain ``pickle.load`` and its
``DefaultLoadPlanner`` reads non-tensor entries (optimizer ``param_groups`` values) with
``torch.load(weights_only=False)``: either would run code from a crafted file. Here:

* :class:`SafeFileSystemReader` reads ``.metadata`` with a
  :class:`~verl_trainer.utils.safe_load.RestrictedUnpickler` that resolves only DCP's metadata classes and
  the few torch values they hold (:data:`DCP_METADATA_GLOBALS`, found by reading the ``.metadata`` of
  FSDP1/FSDP2 model + AdamW checkpoints; plus torch dtypes);
* :class:`SafeLoadPlanner` reads non-tensor entries with ``torch.load(weights_only=True)``;
* tensor data itself is already read with ``weights_only=True`` by torch.

:func:`safe_dcp_load` is ``dcp.load`` with both.
"""

from __future__ import annotations

import io
import os
import pathlib
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem

from verl_trainer.utils.safe_load import RestrictedUnpickler, UnsafeCheckpointError, refusal, safe_torch_load

__all__ = ["DCP_METADATA_GLOBALS", "SafeFileSystemReader", "SafeLoadPlanner", "safe_dcp_load"]

DCP_METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **{
        ("torch.distributed.checkpoint.metadata", cls.__name__): cls
        for cls in (
            dcp_metadata.Metadata,
            dcp_metadata.StorageMeta,
            dcp_metadata.MetadataIndex,
            dcp_metadata.TensorProperties,
            dcp_metadata.TensorStorageMetadata,
            dcp_metadata.BytesStorageMetadata,
            dcp_metadata.ChunkStorageMetadata,
            dcp_metadata._MEM_FORMAT_ENCODING,
        )
    },
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # str -> torch.layout
    ("pathlib", "PosixPath"): pathlib.PosixPath,  # StorageMeta.checkpoint_id
    ("pathlib", "WindowsPath"): pathlib.WindowsPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
}
"""``(module, name) -> object`` of every global a DCP ``.metadata`` file may reference (besides dtypes)."""


def _torch_dtype(module: str, name: str) -> torch.dtype | None:
    value = getattr(torch, name, None) if module == "torch" else None
    return value if isinstance(value, torch.dtype) else None


class SafeFileSystemReader(FileSystemReader):
    """A ``FileSystemReader`` whose ``.metadata`` is unpickled with an allow-list (see the module)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        """Read ``.metadata`` allowing only :data:`DCP_METADATA_GLOBALS` and torch dtypes.

        Raises:
            UnsafeCheckpointError: Naming the file, if it references anything else or is unreadable.
        """
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            unpickler = RestrictedUnpickler(stream, DCP_METADATA_GLOBALS, str(path), _torch_dtype)
            metadata = unpickler.load_checked()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise refusal(path, f"it holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """A ``DefaultLoadPlanner`` that reads non-tensor entries with ``torch.load(weights_only=True)``.

    Args:
        directory: The checkpoint directory (named in errors).
        allow_partial_load: Load only the keys ``state`` has (the checkpoint may hold more).
    """

    def __init__(self, directory: str | os.PathLike, allow_partial_load: bool = False) -> None:
        super().__init__(allow_partial_load=allow_partial_load)
        self.directory = str(directory)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Load one non-tensor entry safely and put it into the state dict."""
        fqn = read_item.dest_index.fqn
        obj = safe_torch_load(value, name=f"{self.directory} (entry {fqn!r})")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def safe_dcp_load(state: dict[str, Any], directory: str | os.PathLike, allow_partial_load: bool = False
                  ) -> None:
    """``dcp.load(state, checkpoint_id=directory)`` reading through the safe reader and planner.

    A collective. Every rank reads ``.metadata`` first (so a refused one fails on every rank with its own
    message); a refused non-tensor entry fails on every rank too (DCP gathers the errors), re-raised here
    as the :class:`~verl_trainer.utils.safe_load.UnsafeCheckpointError` itself. ``allow_partial_load``
    loads only the keys ``state`` has (e.g. some of the model's tensors, as the HF export does).

    Raises:
        UnsafeCheckpointError: Naming the file or entry that was refused.
    """
    SafeFileSystemReader(directory).read_metadata()
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(directory),
                 planner=SafeLoadPlanner(directory, allow_partial_load))
    except CheckpointException as exc:
        refused = [err for err, _ in exc.failures.values() if isinstance(err, UnsafeCheckpointError)]
        if refused:
            raise refused[0] from None
        raise
