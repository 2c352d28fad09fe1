"""Rollout: sample responses from the current policy (HF ``generate`` everywhere, vLLM on GPU).

``build_rollout(config, model_path)`` picks the backend. ``vllm`` is never imported unless it is
installed and chosen: :class:`VLLMRollout` loads on first access of the attribute.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

from verl_trainer.rollout.base import (
    RESPONSE_TEXT,
    ROLLOUT_NON_TENSOR_KEYS,
    BaseRollout,
    derive_seed,
    truncate_at_eos,
)
from verl_trainer.rollout.config import RolloutConfig
from verl_trainer.rollout.hf import HFRollout

__all__ = [
    "RESPONSE_TEXT",
    "ROLLOUT_NON_TENSOR_KEYS",
    "BaseRollout",
    "HFRollout",
    "RolloutConfig",
    "build_rollout",
    "derive_seed",
    "resolve_rollout_name",
    "truncate_at_eos",
    "vllm_available",
]


def vllm_available() -> bool:
    """True when the ``vllm`` package is installed (checked without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def resolve_rollout_name(name: str) -> str:
    """``"auto"`` -> ``"vllm"`` when vllm is installed and CUDA is available, else ``"hf"``."""
    if name == "auto":
        return "vllm" if vllm_available() and torch.cuda.is_available() else "hf"
    return name


def build_rollout(config: RolloutConfig, model: Any, tokenizer: Any = None) -> BaseRollout:
    """Build the rollout backend named by ``config.name``.

    Args:
        config: Rollout settings.
        model: A checkpoint directory (both backends) or a transformers model (``hf`` only).
        tokenizer: Defaults to the tokenizer saved with the checkpoint.

    Returns:
        An :class:`HFRollout` or :class:`VLLMRollout`.

    """
    name = resolve_rollout_name(config.name)
    if name == "vllm":
        if not vllm_available():
            raise ImportError("RolloutConfig(name='vllm') needs the vllm package (pip install vllm), "
                              "or use name='hf' / 'auto'")
        from verl_trainer.rollout.vllm_rollout import VLLMRollout

        if not isinstance(model, (str, Path)):
            raise ValueError("the vllm rollout loads from a checkpoint directory; pass a path")
        return VLLMRollout(config, model, tokenizer)
    return HFRollout(config, model, tokenizer)


def __getattr__(name: str) -> Any:
    if name == "VLLMRollout":
        from verl_trainer.rollout.vllm_rollout import VLLMRollout

        return VLLMRollout
    raise AttributeError(f"module 'verl_trainer.rollout' has no attribute {name!r}")
