"""Manifests at 2 gloo ranks: each rank hashes a share, and a damaged file fails on every rank together."""

from __future__ import annotations

from pathlib import Path

from verl_trainer.testing import run_distributed


def _rank(root: str) -> dict:
    import torch.distributed as dist

    from verl_trainer.utils.manifest import CorruptCheckpointError, verify_manifest, write_manifest

    rank, directory = dist.get_rank(), Path(root)
    (directory / f"shard_rank{rank}.bin").write_bytes(bytes([rank]) * 4096)
    dist.barrier()
    manifest = write_manifest(directory)
    dist.barrier()
    verify_manifest(directory)  # intact
    if rank == 0:
        data = bytearray((directory / "shard_rank1.bin").read_bytes())
        data[2048] ^= 0xFF  # in the share rank 1 checks
        (directory / "shard_rank1.bin").write_bytes(bytes(data))
    dist.barrier()
    try:
        verify_manifest(directory)
        error = None
    except CorruptCheckpointError as exc:
        error = str(exc)
    return {"files": sorted(manifest["files"]), "error": error}


def test_every_rank_raises_the_same_error_for_a_file_another_rank_checked(tmp_path):
    out = run_distributed(_rank, 2, str(tmp_path), timeout=120)
    assert out[0]["files"] == out[1]["files"] == ["shard_rank0.bin", "shard_rank1.bin"]
    assert out[0]["error"] is not None and out[0]["error"] == out[1]["error"]
    assert "shard_rank1.bin: sha256 differs" in out[0]["error"]
