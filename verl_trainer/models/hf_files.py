"""The one home of what names an HF model directory's files and what the project calls its models.

Read by the loaders (``models/``), the engines (checkpoints, LoRA, ``save_hf``) and the converter
(``python -m verl_trainer.export``); nothing here imports a project module, so every layer may use it.

* File names: :data:`CONFIG_NAME`, :data:`GENERATION_CONFIG_NAME`, :data:`SAFE_WEIGHTS_NAME` (one file),
  :data:`SAFE_WEIGHTS_INDEX_NAME` (the index of a sharded model), :data:`TOKENIZER_FILES`.
* :data:`MODEL_TYPES`: the model types every engine backend registers (``engine/heads.py`` holds their
  classes) and an HF directory is written for.
* :data:`DTYPES` / :func:`to_dtype`: the dtype names configs and commands accept.
"""

from __future__ import annotations

import torch

__all__ = [
    "CONFIG_NAME", "DTYPES", "GENERATION_CONFIG_NAME", "MODEL_TYPES", "PROCESSOR_FILES",
    "SAFE_WEIGHTS_INDEX_NAME", "SAFE_WEIGHTS_NAME", "TOKENIZER_FILES", "to_dtype",
]

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
"""A directory holding one of these has a tokenizer."""
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "chat_template.json",
                   "chat_template.jinja")
"""A vision-language model's processor files (``AutoImageProcessor.from_pretrained`` reads the first); an
export copies them from the model it was trained from."""

MODEL_TYPES = ("language_model", "value_model")
"""``language_model``: ``*ForCausalLM``; ``value_model``: ``*ForTokenClassification`` (``num_labels=1``)."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
"""Dtype names (torch's and the short ones) to ``torch.dtype``."""


def to_dtype(name: str | torch.dtype) -> torch.dtype:
    """Return the ``torch.dtype`` named e.g. ``"bf16"`` / ``"float32"`` (a dtype is returned as is).

    Raises:
        ValueError: For a name outside :data:`DTYPES`, listing them.
    """
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None
