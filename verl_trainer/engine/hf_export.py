"""The export part of an engine: its model written as a standard HF directory (``BaseEngine.save_hf``).

The weights come from the engine's :class:`~verl_trainer.engine.weights.WeightStream` (LoRA merged); what
an HF directory holds besides them (the config, ``generation_config.json``, the tokenizer) comes from the
model the engine loaded. The files are written by ``models/hf_dir.py: save_hf_model``, which the
checkpoint converter (``python -m verl_trainer.export``) writes through as well.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from verl_trainer.models.hf_dir import save_hf_model
from verl_trainer.models.hf_sources import generation_config_of, tokenizer_dir

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

__all__ = ["HFExport"]


@dataclass(frozen=True)
class HFExport:
    """What an engine's HF directory holds besides the weights.

    Attributes:
        model_path: The engine's ``EngineConfig.model_path`` (its tokenizer and generation config are
            copied; ``None`` or a path without them: not written).
        model_config: The loaded model's HF config.
        model_type: ``"language_model"`` or ``"value_model"`` (which HF class the directory loads as).
    """

    model_path: str | None
    model_config: PretrainedConfig
    model_type: str

    def save(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        path: str | os.PathLike,
        tokenizer: PreTrainedTokenizerBase | str | os.PathLike | None = "model_path",
        max_shard_size: int | str = "5GB",
        dtype: torch.dtype | None = None,
    ) -> str:
        """Write ``named_tensors`` and the model's files as an HF directory at ``path``; a collective.

        ``config.json``, ``model.safetensors`` (sharded above ``max_shard_size``, with the index),
        ``generation_config.json`` and the tokenizer: ``AutoModelForCausalLM.from_pretrained(path)`` (a value
        model: ``AutoModelForTokenClassification``, with its ``score`` head; a vision-language model:
        ``AutoModelForImageTextToText``, both towers, its image processor files copied along) loads it.
        Rank 0 holds at most one shard and writes under a temporary name renamed to ``path`` when complete.

        Args:
            named_tensors: ``(hf_name, full_tensor)``, one at a time (consumed on every rank).
            path: The output directory (replaced only if verl-trainer wrote it).
            tokenizer: A tokenizer, a directory to load one from, ``"model_path"`` (the model's own, when
                :attr:`model_path` has one) or ``None`` (none written).
            max_shard_size: Bytes per safetensors file (int or e.g. ``"2GB"``).
            dtype: Save floating-point weights in this dtype (default: as they arrive).

        Returns:
            ``str(path)``.

        Raises:
            NotOwnedError: ``path`` holds files verl-trainer did not write.
            ValueError: The tensors do not match the architecture of :attr:`model_config`.
        """
        if isinstance(tokenizer, str) and tokenizer == "model_path":
            tokenizer = tokenizer_dir(self.model_path)
        return save_hf_model(
            named_tensors, path, self.model_config, self.model_type, tokenizer=tokenizer,
            generation_config=generation_config_of(self.model_path), max_shard_size=max_shard_size,
            dtype=dtype, processor_dir=tokenizer_dir(self.model_path),
        )
