"""Integrity manifests: a corrupted, truncated or missing file is refused, naming it (single process)."""

from __future__ import annotations

import json

import pytest

from verl_trainer.utils.manifest import MANIFEST_FILE, CorruptCheckpointError, verify_manifest, write_manifest


def _checkpoint(root):
    (root / "engines" / "actor").mkdir(parents=True)
    (root / "engines" / "actor" / "weights.bin").write_bytes(bytes(range(256)) * 64)
    write_manifest(root / "engines" / "actor")  # an engine's own manifest, nested in the trainer's
    (root / "rng_rank0.pt").write_bytes(b"r" * 1000)
    (root / "meta.json").write_text("{}")
    return write_manifest(root)


def test_manifest_records_every_file_and_covers_nested_ones_by_their_manifest(tmp_path):
    manifest = _checkpoint(tmp_path)
    assert sorted(manifest["files"]) == ["engines/actor/manifest.json", "meta.json", "rng_rank0.pt"]
    assert manifest["nested"] == ["engines/actor"]
    assert manifest["files"]["rng_rank0.pt"]["size"] == 1000
    assert json.loads((tmp_path / MANIFEST_FILE).read_text()) == manifest
    verify_manifest(tmp_path)  # intact: no error


def test_flipped_middle_bytes_are_refused_naming_the_file(tmp_path):
    _checkpoint(tmp_path)
    weights = tmp_path / "engines" / "actor" / "weights.bin"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))  # same size, different content
    with pytest.raises(CorruptCheckpointError, match=r"weights.bin: sha256 differs"):
        verify_manifest(tmp_path)
    verify_manifest(tmp_path, recurse=False)  # the outer manifest alone does not read the engine's files


def test_truncated_and_missing_files_are_refused_naming_them(tmp_path):
    _checkpoint(tmp_path)
    rng = tmp_path / "rng_rank0.pt"
    rng.write_bytes(rng.read_bytes()[:10])
    (tmp_path / "meta.json").unlink()
    with pytest.raises(CorruptCheckpointError) as err:
        verify_manifest(tmp_path)
    message = str(err.value)
    assert "rng_rank0.pt: 10 bytes, the manifest records 1000" in message
    assert "meta.json: missing" in message and "ckpt_path=" in message


def test_missing_or_unreadable_manifest_is_refused(tmp_path):
    _checkpoint(tmp_path)
    (tmp_path / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match=r"manifest.json' is unreadable"):
        verify_manifest(tmp_path)
    (tmp_path / MANIFEST_FILE).unlink()
    with pytest.raises(CorruptCheckpointError, match=r"has no manifest.json.*write_manifest"):
        verify_manifest(tmp_path)
