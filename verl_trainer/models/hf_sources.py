"""What an export copies from the model it started from: the tokenizer and the generation config.

The weights of an export come from the engine (or a checkpoint); the tokenizer and ``generation_config.json``
come from the directory the run loaded its model from (``EngineConfig.model_path``), or from a checkpoint's
``huggingface/`` folder, which holds them for exactly this (:func:`save_model_files`). A source without
them (e.g. a model built by a factory) exports without them rather than failing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from verl_trainer.models.hf_files import GENERATION_CONFIG_NAME, TOKENIZER_FILES
from verl_trainer.models.loading import load_tokenizer
from verl_trainer.models.source import ModelNotFoundError, resolve_model_path

if TYPE_CHECKING:
    from transformers import GenerationConfig

__all__ = ["generation_config_of", "save_model_files", "tokenizer_dir"]


def _local(path: str | os.PathLike | None) -> Path | None:
    if not path:
        return None
    try:
        return Path(resolve_model_path(path))
    except ModelNotFoundError:
        return Path(path) if Path(path).is_dir() else None


def tokenizer_dir(path: str | os.PathLike | None) -> str | None:
    """``path`` (resolved as a model path) when it holds a tokenizer, else ``None``."""
    local = _local(path)
    if local is None or not any((local / name).is_file() for name in TOKENIZER_FILES):
        return None
    return str(local)


def generation_config_of(path: str | os.PathLike | None) -> GenerationConfig | None:
    """The ``GenerationConfig`` saved in ``path`` (``generation_config.json``), or ``None``."""
    local = _local(path)
    if local is None or not (local / GENERATION_CONFIG_NAME).is_file():
        return None
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(str(local))


def save_model_files(source: str | os.PathLike | None, directory: str | os.PathLike) -> None:
    """Copy ``source``'s tokenizer and generation config into ``directory`` (what an export needs later).

    Nothing is written for what ``source`` does not have.
    """
    tokenizer = tokenizer_dir(source)
    if tokenizer is not None:

        load_tokenizer(tokenizer).save_pretrained(str(directory))
    generation = generation_config_of(source)
    if generation is not None:
        generation.save_pretrained(str(directory))
