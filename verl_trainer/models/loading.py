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
    AutoModelForImageTextToText,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

import verl_trainer.models.attention  # noqa: F401  (registers "verl_varlen" before any from_pretrained)
from verl_trainer.models.source import resolve_model_path
from verl_trainer.models.vlm import is_vision_language, vlm_attention
from verl_trainer.models.weight_files import check_weight_dir

__all__ = ["load_causal_lm", "load_reward_model", "load_tokenizer", "load_value_model"]


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

    A vision-language checkpoint (its config has a ``vision_config``: ``models/vlm.py``) loads with
    ``AutoModelForImageTextToText`` (both towers), ``attn_implementation`` on its language model and sdpa
    on its vision tower.

    Args:
        path: An HF checkpoint directory (e.g. written by ``make_tiny_model``) or a cached hub id.
        attn_implementation: ``None`` (transformers' default, sdpa), ``"eager"``, ``"sdpa"``,
            ``"verl_varlen"`` (padding-free, ``verl_trainer.models.attention``), ...
        torch_dtype: Parameter dtype.
        **kwargs: Passed on to ``from_pretrained`` (config overrides included).

    Returns:
        The model (train mode is left to the caller; ``from_pretrained`` returns it in eval mode).

    Raises:
        DamagedWeightsError: If a ``*.safetensors`` file is truncated (naming it), before loading.

    """
    path = resolve_model_path(path)
    check_weight_dir(path)  # a truncated model.safetensors is named, not a deep safetensors error
    config = kwargs.get("config") or AutoConfig.from_pretrained(path)
    if is_vision_language(config):
        model = AutoModelForImageTextToText.from_pretrained(
            path, attn_implementation=vlm_attention(attn_implementation), dtype=torch_dtype, **kwargs
        )
        if attn_implementation is not None:
            model.config._attn_implementation = attn_implementation
        return model
    return AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=attn_implementation, dtype=torch_dtype, **kwargs
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

    Raises:
        ValueError: ``path`` is a vision-language model (no value head for it).

    """
    path = resolve_model_path(path)
    check_weight_dir(path)
    config = kwargs.pop("config", None) or AutoConfig.from_pretrained(path)
    if is_vision_language(config):
        raise ValueError(
            f"{path!r} is a vision-language model: a value model (critic) of it is not supported "
            "(transformers has no token-classification head for it); train it with a critic-free "
            "estimator (GRPO, RLOO, ReMax: algorithm.adv_estimator) or give the critic a text-only model"
        )
    config.num_labels = 1
    default_dropout = getattr(config, "classifier_dropout", None) or 0.0
    config.classifier_dropout = kwargs.pop("classifier_dropout", default_dropout)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForTokenClassification.from_pretrained(
            path, config=config, attn_implementation=attn_implementation, dtype=torch_dtype, **kwargs
        )


def load_reward_model(path: str | Path, attn_implementation: str | None = None,
                      torch_dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A frozen reward model (a ``*ForSequenceClassification`` checkpoint, one label) as a value model.

    It is loaded as ``AutoModelForTokenClassification`` with one label (what the ``value_model`` engines
    run: a score per position), with the checkpoint's own head: a sequence classifier's ``score`` has no
    bias, so none is added. The score of a whole sequence is the head at its last token.

    Raises:
        ValueError: The checkpoint has no trained ``score`` head (not a reward model), or more than one label.
    """
    path = resolve_model_path(path)
    config = AutoConfig.from_pretrained(path)
    classifier = any(str(a).endswith("ForSequenceClassification") for a in config.architectures or [])
    if classifier and config.num_labels != 1:
        raise ValueError(f"reward model {path!r} has num_labels={config.num_labels}; a reward model scores "
                         "with one label (AutoModelForSequenceClassification(num_labels=1))")
    config.num_labels = 1
    config.token_classification_bias = False
    config.classifier_dropout = 0.0
    model, info = AutoModelForTokenClassification.from_pretrained(
        path, config=config, attn_implementation=attn_implementation, dtype=torch_dtype,
        output_loading_info=True)
    if any(key.startswith("score.") for key in info.get("missing_keys", ())):
        raise ValueError(f"{path!r} has no trained 'score' head, so it is not a reward model: save an "
                         "AutoModelForSequenceClassification(num_labels=1) there")
    return model.eval().requires_grad_(False)
