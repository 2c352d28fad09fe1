"""Loading HF models and tokenizers with the real ``from_pretrained`` path, never from the network.

The engines, the rollout and the recipes load every model through these three functions, so padding-free
attention is registered first and a value model gets its scalar head the same way everywhere. A path is a
local HF directory or a hub id already in the local HF cache (:func:`~verl_trainer.models.source.
resolve_model_path`); anything else fails with a message that says how to fix it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

import verl_trainer.models.attention  # noqa: F401  (registers "verl_varlen" before any from_pretrained)
from verl_trainer.models.source import resolve_model_path

__all__ = ["load_causal_lm", "load_tokenizer", "load_value_model"]


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """``AutoTokenizer.from_pretrained`` on a local directory (or a cached hub id)."""
    return AutoTokenizer.from_pretrained(resolve_model_path(path))


def load_causal_lm(
    path: str | Path,
    attn_implementation: str | None = None,
    torch_dtype: torch.dtype = torch.float32,
    **kwargs: Any,
) -> PreTrainedModel:
    """Load a causal LM with ``AutoModelForCausalLM.from_pretrained`` from a local directory.

    Args:
        path: An HF checkpoint directory (e.g. written by ``make_tiny_model``) or a cached hub id.
        attn_implementation: ``None`` (transformers' default, sdpa), ``"eager"``, ``"sdpa"``,
            ``"verl_varlen"`` (padding-free, ``verl_trainer.models.attention``), ...
        torch_dtype: Parameter dtype.
        **kwargs: Passed on to ``from_pretrained`` (config overrides included).

    Returns:
        The model (train mode is left to the caller; ``from_pretrained`` returns it in eval mode).

    """
    return AutoModelForCausalLM.from_pretrained(
        resolve_model_path(path), attn_implementation=attn_implementation, dtype=torch_dtype, **kwargs
    )


def load_value_model(
    path: str | Path,
    attn_implementation: str | None = None,
    torch_dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **kwargs: Any,
) -> PreTrainedModel:
    """Load a value (critic) model: ``AutoModelForTokenClassification`` with ``num_labels=1``.

    The backbone comes from the checkpoint (typically the actor's); the scalar head ``score`` is new and
    initialised from ``seed`` (identically on every rank). Head dropout is 0 unless overridden, so a
    value forward is deterministic in train mode as well.

    Args:
        path: Checkpoint directory.
        attn_implementation: As for :func:`load_causal_lm`.
        torch_dtype: Parameter dtype.
        seed: Seed of the new head's initialisation (the global RNG state is left untouched).
        **kwargs: Passed on to ``from_pretrained``.

    Returns:
        The model; its output ``logits`` are ``[B, T, 1]``.

    """
    path = resolve_model_path(path)
    config = kwargs.pop("config", None) or AutoConfig.from_pretrained(path)
    config.num_labels = 1
    default_dropout = getattr(config, "classifier_dropout", None) or 0.0
    config.classifier_dropout = kwargs.pop("classifier_dropout", default_dropout)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForTokenClassification.from_pretrained(
            path, config=config, attn_implementation=attn_implementation, dtype=torch_dtype, **kwargs
        )
