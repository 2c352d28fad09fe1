"""A hub dataset written into a local HF hub cache offline, in the layout ``huggingface_hub`` writes.

``hf_hub_download`` stores a repository file as ``<cache>/datasets--<org>--<name>/blobs/<etag>`` (the etag:
the sha256 of an LFS file such as a parquet shard, the git blob sha1 of a small text file), links it from
``snapshots/<commit>/<path in repo>`` by a relative symlink, and records the commit of the branch in
``refs/main``. :func:`write_cached_dataset` writes the same, so the real lookup
(``snapshot_download(..., local_files_only=True)``, ``huggingface_hub.scan_cache_dir``) finds it, for
tests of code that reads cached hub datasets (:mod:`verl_trainer.data.hub`) on a machine without the Hub.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["parquet_bytes", "write_cached_dataset"]

LFS_SUFFIXES = (".parquet", ".arrow")
"""Files the Hub stores with git LFS (their etag is the sha256 of the content)."""


def parquet_bytes(rows: Sequence[Mapping[str, Any]]) -> bytes:
    """``rows`` as a parquet file's bytes (pyarrow)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(list(rows)), buffer)
    return buffer.getvalue()


def _etag(name: str, data: bytes) -> str:
    if Path(name).suffix in LFS_SUFFIXES:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id


def write_cached_dataset(cache_dir: str | os.PathLike, repo_id: str, files: Mapping[str, bytes | str],
                         commit: str = "0" * 40) -> Path:
    """Write the dataset repository ``repo_id`` at ``commit`` into the hub cache ``cache_dir``.

    Args:
        cache_dir: The hub cache (``HF_HUB_CACHE``, or ``HF_HOME/hub``).
        repo_id: ``org/name``.
        files: Path in the repository -> content (``str`` is written as UTF-8).
        commit: The commit hash (40 hex digits) ``refs/main`` names.

    Returns:
        The snapshot directory.
    """
    repo = Path(cache_dir) / f"datasets--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for name, content in files.items():
        data = content.encode() if isinstance(content, str) else content
        blob = repo / "blobs" / _etag(name, data)
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        pointer = snapshot / name
        pointer.parent.mkdir(parents=True, exist_ok=True)
        pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot
