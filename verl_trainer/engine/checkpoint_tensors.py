"""An engine checkpoint's model tensors, read on one process without the run that wrote it.

What the checkpoint converter (``python -m verl_trainer.export``) reads; every file is read pickle-free:

* FSDP / FSDP2 (DCP, ``dcp/``): ``.metadata`` through ``engine/safe_dcp.py: SafeFileSystemReader``; the
  tensors are read one group of at most ``shard_bytes`` at a time (a partial ``dcp.load`` of just
  those), so no more than one group is in memory;
* DeepSpeed ZeRO-1/2/3 (``deepspeed/``): DeepSpeed's own consolidation
  (``get_fp32_state_dict_from_zero_checkpoint``: the fp32 master weights) with every ``torch.load`` forced to
  ``weights_only``; it holds the full fp32 model in memory once.

A LoRA checkpoint holds the adapters, not the base weights: it is refused (the run's ``save_hf`` merges).
"""

from __future__ import annotations

import os
import pickle
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch

from verl_trainer.engine.checkpoint import DCP_SUBDIR, DEEPSPEED_SUBDIR, META_FILE
from verl_trainer.utils.safe_load import refusal

__all__ = ["is_engine_checkpoint", "model_tensors"]

MODEL_PREFIX = "model."  # DCP flattens {"model": {fqn: tensor}, "optimizer": ...} to "model.<fqn>"


def is_engine_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is one engine's checkpoint (``meta.json`` and ``dcp/`` or ``deepspeed/``)."""
    root = Path(path)
    state = (root / DCP_SUBDIR).is_dir() or (root / DEEPSPEED_SUBDIR).is_dir()
    return (root / META_FILE).is_file() and state


def model_tensors(directory: str | os.PathLike, order: Sequence[str], shard_bytes: int
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(state-dict name, tensor)`` of the model in the engine checkpoint ``directory``, one at a time.

    Args:
        directory: One engine's checkpoint (:func:`is_engine_checkpoint`).
        order: The names in the order wanted (DCP); names not in it follow, in the checkpoint's order.
        shard_bytes: DCP: bytes read at once (a group of tensors).

    Raises:
        ValueError: A LoRA checkpoint (adapters, not base weights).
        UnsafeCheckpointError: A DeepSpeed file holds anything but tensors and plain data.
    """
    root = Path(directory)
    if (root / DCP_SUBDIR).is_dir():
        return _dcp_tensors(root / DCP_SUBDIR, order, shard_bytes)
    return _deepspeed_tensors(root / DEEPSPEED_SUBDIR)


def _refuse_adapters(names: Iterable[str], where: Path) -> None:
    """Raise for a LoRA checkpoint: it holds the adapters, not the base weights the export needs."""
    adapters = [name for name in names if "lora_" in name]
    if adapters:
        raise ValueError(
            f"{str(where)!r} is a LoRA checkpoint (it holds adapters such as {adapters[0]!r}, not the base "
            f"weights); export a LoRA run with engine.save_hf(path) or ModelCheckpoint(save_hf=True), which "
            f"write the merged model"
        )


def _dcp_tensors(dcp_dir: Path, order: Sequence[str], shard_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The model tensors of a DCP checkpoint, read in groups of at most ``shard_bytes`` (one process)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from verl_trainer.engine.safe_dcp import (  # lazy: loads torch DCP only when used
        SafeFileSystemReader,
        safe_dcp_load,
    )

    metadata = SafeFileSystemReader(dcp_dir).read_metadata()
    stored = {key.removeprefix(MODEL_PREFIX): meta for key, meta in metadata.state_dict_metadata.items()
              if key.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)}
    _refuse_adapters(stored, dcp_dir)
    names = [name for name in order if name in stored]
    names += [name for name in stored if name not in set(names)]  # unexpected ones: the caller reports them
    group: list[str] = []
    size = 0

    def load(group_names: list[str]) -> dict[str, torch.Tensor]:
        state = {"model": {n: torch.empty(tuple(stored[n].size), dtype=stored[n].properties.dtype)
                           for n in group_names}}
        with warnings.catch_warnings():  # one process on purpose: DCP's "assuming a single process" note
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            safe_dcp_load(state, dcp_dir, allow_partial_load=True)
        return state["model"]

    for name in names:
        meta = stored[name]
        nbytes = meta.size.numel() * torch.empty((), dtype=meta.properties.dtype).element_size()
        if group and size + nbytes > shard_bytes:
            yield from load(group).items()
            group, size = [], 0
        group.append(name)
        size += nbytes
    if group:
        yield from load(group).items()


def _deepspeed_tensors(ds_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The fp32 weights of a DeepSpeed checkpoint (DeepSpeed's consolidation, ``weights_only`` loads)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from verl_trainer.engine.deepspeed_checkpoint import (  # lazy: only DeepSpeed checkpoints need it
        CHECKPOINT_TAG,
        weights_only_torch_load,
    )

    try:
        with weights_only_torch_load():
            state = get_fp32_state_dict_from_zero_checkpoint(str(ds_dir), tag=CHECKPOINT_TAG)
    except pickle.UnpicklingError as exc:
        raise refusal(ds_dir / CHECKPOINT_TAG, f"a file in it failed to load ({exc})") from None
    _refuse_adapters(state, ds_dir)
    while state:
        name = next(iter(state))
        yield name, state.pop(name)  # released as it is written
