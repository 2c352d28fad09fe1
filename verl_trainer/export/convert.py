"""Convert a saved checkpoint into an HF directory on one process, without the run that wrote it.

``python -m verl_trainer.export CKPT_DIR OUT_DIR`` (``__main__.py``) calls :func:`convert_checkpoint`.
``CKPT_DIR`` may be a trainer checkpoint (``step_000003/``: the ``actor`` engine, or ``--engine critic``), a
checkpoint directory (``checkpoints/``: its newest complete ``step_*``), or one engine's checkpoint
(``step_000003/engines/actor``). The checkpoint is verified against its manifest first; its model tensors
are read pickle-free by the engine's reader (``engine/checkpoint_tensors.py``: DCP one shard-sized group at
a time, DeepSpeed through its fp32 consolidation).

The config, tokenizer and generation config come from the checkpoint's ``huggingface/`` folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from verl_trainer.engine.checkpoint import HF_DIR, META_FILE
from verl_trainer.engine.checkpoint_dirs import ENGINES_DIR, STATE_FILE, find_last_checkpoint
from verl_trainer.engine.checkpoint_tensors import is_engine_checkpoint, model_tensors
from verl_trainer.models.hf_dir import HF_MODEL_KINDS, HFLayout, save_hf_model
from verl_trainer.models.hf_files import CONFIG_NAME
from verl_trainer.models.hf_sources import generation_config_of, tokenizer_dir
from verl_trainer.models.safetensors_shards import parse_size
from verl_trainer.utils.fs import ensure_replaceable
from verl_trainer.utils.manifest import verify_manifest

__all__ = ["convert_checkpoint", "find_engine_checkpoint"]


def find_engine_checkpoint(path: str | os.PathLike, engine: str = "actor") -> Path:
    """The engine checkpoint directory ``path`` designates (see the module).

    Raises:
        FileNotFoundError: Naming ``path``, what was looked for, and the engines it has.
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(root)!r} does not exist")
    if is_engine_checkpoint(root):
        return root
    if not (root / STATE_FILE).is_file():
        last = find_last_checkpoint(root)
        if last is None:
            raise FileNotFoundError(
                f"{str(root)!r} is not a checkpoint: it has no {STATE_FILE} (trainer checkpoint step_*), no "
                f"meta.json + dcp/ or deepspeed/ (an engine checkpoint), and no complete step_* checkpoint "
                f"inside; pass a step_* directory, the checkpoints directory, or step_*/engines/<name>"
            )
        root = last
    found = root / ENGINES_DIR / engine
    if not found.is_dir():
        have = sorted(p.name for p in (root / ENGINES_DIR).glob("*"))
        raise FileNotFoundError(
            f"checkpoint {str(root)!r} has no engine {engine!r} (it has {have}); choose one with --engine"
        )
    return found


def _refuse_overlap(ckpt: Path, out: Path, found: Path) -> None:
    """Raise if ``out`` is, lies inside, or contains the checkpoint (as given, or the one it designates)."""
    target = out.resolve()
    for source in dict.fromkeys((ckpt.resolve(), found.resolve())):
        if target == source or source in target.parents or target in source.parents:
            relation = ("is" if target == source else "lies inside" if source in target.parents
                        else "contains")
            raise ValueError(
                f"OUT_DIR={str(out)!r} {relation} the checkpoint {str(source)!r}; the export would replace "
                f"or mix with the checkpoint it reads. Choose an OUT_DIR outside the checkpoint directory"
            )


def convert_checkpoint(
    ckpt_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    engine: str = "actor",
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    tokenizer: str | os.PathLike | None = None,
) -> str:
    """Write the model of a saved checkpoint as an HF directory (config, safetensors, tokenizer).

    Args:
        ckpt_dir: A trainer checkpoint, a checkpoints directory, or an engine checkpoint (see the module).
        out_dir: The output directory (replaced only if verl-trainer wrote it).
        engine: Which engine of a trainer checkpoint (``actor``, ``critic``, ...).
        max_shard_size: Bytes per safetensors file (int or e.g. ``"5GB"``).
        dtype: Save floating-point weights in this dtype (default: as stored).
        tokenizer: Where to take the tokenizer from when the checkpoint has none (default: its
            ``huggingface/`` folder, else the ``model_path`` it records).

    Returns:
        ``str(out_dir)``.

    Raises:
        FileNotFoundError: If ``ckpt_dir`` is not a checkpoint (or lacks the engine).
        ValueError: If ``out_dir`` is, lies inside or contains the checkpoint.
        NotOwnedError: If ``out_dir`` holds a user's files or another kind of the project's directories.
        CorruptCheckpointError: If a file differs from the checkpoint's manifest.
        UnsafeCheckpointError: If a file holds anything but tensors and plain data.
    """
    from transformers import AutoConfig

    directory = find_engine_checkpoint(ckpt_dir, engine)
    _refuse_overlap(Path(ckpt_dir), Path(out_dir), directory)
    ensure_replaceable(out_dir, "OUT_DIR", HF_MODEL_KINDS)
    verify_manifest(directory)
    meta: dict[str, Any] = json.loads((directory / META_FILE).read_text())
    hf_dir = directory / HF_DIR
    if not (hf_dir / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"checkpoint {str(directory)!r} has no {HF_DIR}/{CONFIG_NAME} to export with")
    config = AutoConfig.from_pretrained(str(hf_dir))
    model_type = meta.get("model_type", "language_model")
    layout = HFLayout(config, model_type)
    named = model_tensors(directory, layout.names, parse_size(max_shard_size))
    source = tokenizer or tokenizer_dir(hf_dir) or tokenizer_dir(meta.get("model_path"))
    return save_hf_model(named, out_dir, config, model_type, tokenizer=source,
                         generation_config=generation_config_of(hf_dir), max_shard_size=max_shard_size,
                         dtype=dtype, what="OUT_DIR")
