"""Rollout: sample responses from the current policy (HF ``generate``, a colocated vLLM engine, or yours).

``build_rollout(config, model_path)`` builds the backend ``config.name`` names through the rollout
registry (:mod:`verl_trainer.rollout.registry`: a registered name, ``"module:Class"`` or
``"file.py:Class"``). Importing this package registers ``hf`` and ``vllm``; the ``vllm`` package itself is
imported only when a vLLM engine is built. ``docs/rollout.md`` compares the two, states the ``auto`` rule
and shows how to add a backend.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from verl_trainer.agents.budget import warn_if_no_call_fits
from verl_trainer.rollout.agent_loop import AgentLoop, Trajectory
from verl_trainer.rollout.base import (
    AGENT_INFO,
    RESPONSE_TEXT,
    ROLLOUT_NON_TENSOR_KEYS,
    BaseRollout,
    derive_sample_seed,
    truncate_at_eos,
)
from verl_trainer.rollout.config import RolloutConfig
from verl_trainer.rollout.hf import HFRollout
from verl_trainer.rollout.registry import ROLLOUT_REGISTRY, register_rollout, rollout_class
from verl_trainer.rollout.vllm_rollout import VLLMRollout
from verl_trainer.rollout.vllm_support import check_vllm_rollout, model_config, vllm_available

__all__ = [
    "AGENT_INFO",
    "AUTO_CPU_VLLM_MIN_PARAMS",
    "AgentLoop",
    "RESPONSE_TEXT",
    "ROLLOUT_NON_TENSOR_KEYS",
    "BaseRollout",
    "HFRollout",
    "ROLLOUT_REGISTRY",
    "RolloutConfig",
    "Trajectory",
    "build_rollout",
    "decoder_params",
    "check_vllm_rollout",
    "derive_sample_seed",
    "register_rollout",
    "resolve_rollout_name",
    "rollout_class",
    "truncate_at_eos",
    "VLLMRollout",
    "vllm_available",
]


AUTO_CPU_VLLM_MIN_PARAMS = 25_000_000
"""``auto`` on CPU picks vLLM for models with at least this many decoder parameters (``12 * layers *
hidden**2``): the smallest shape of ``bench/rollout.py`` where vLLM is faster per token (the figures and how
to re-measure: docs/rollout.md, "``auto``")."""


def decoder_params(model: str | Path) -> int:
    """``12 * num_hidden_layers * hidden_size**2``: a transformer's decoder parameters, from config.json."""
    config = model_config(model)
    return 12 * int(config["num_hidden_layers"]) * int(config["hidden_size"]) ** 2


def resolve_rollout_name(config: RolloutConfig | str,
                         model: str | Path | PreTrainedModel | None = None) -> str:
    """The backend ``"auto"`` stands for where this runs (any other name is returned as is).

    ``"vllm"`` when vllm is installed, ``model`` is a checkpoint directory vLLM can run here
    (:func:`check_vllm_rollout`), and either CUDA is available or the model is large enough for vLLM to be
    faster on CPU (:data:`AUTO_CPU_VLLM_MIN_PARAMS`); else ``"hf"`` (``docs/rollout.md``).

    Args:
        config: The rollout settings, or just the name.
        model: The policy's checkpoint directory (``None`` or a model object: ``"hf"``).
    """
    name = config if isinstance(config, str) else config.name
    if name != "auto":
        return name
    if not (vllm_available() and isinstance(model, (str, Path))):
        return "hf"
    try:
        if not torch.cuda.is_available() and decoder_params(model) < AUTO_CPU_VLLM_MIN_PARAMS:
            return "hf"
        check_vllm_rollout(model, 1 if isinstance(config, str) else config.tensor_parallel_size)
    except (ValueError, FileNotFoundError, KeyError):
        return "hf"
    return "vllm"


def build_rollout(config: RolloutConfig, model: str | Path | PreTrainedModel,
                  tokenizer: PreTrainedTokenizerBase | None = None) -> BaseRollout:
    """Build the rollout backend named by ``config.name`` (``"auto"`` resolved here first).

    Args:
        config: Rollout settings.
        model: A checkpoint directory (every backend) or a transformers model (``hf`` and backends that
            take one).
        tokenizer: Defaults to the tokenizer saved with the checkpoint.

    Returns:
        An instance of the named :class:`BaseRollout` subclass, built as ``cls(config, model, tokenizer)``
        after ``cls.check(config, model)``; with ``config.multi_turn.enable`` it rolls out multi-turn
        trajectories through an :class:`AgentLoop`.

    Raises:
        UnknownKeyError, ValueError, ImportError: From :func:`rollout_class` and the backend's ``check``,
            before any model loads.
    """
    backend = rollout_class(resolve_rollout_name(config, model))
    backend.check(config, model)  # before any model loads
    rollout = backend(config, model, tokenizer)  # the constructor every backend has (BaseRollout)
    if config.multi_turn.enable and config.multi_turn.agent is not None:  # an agent over the token server
        from verl_trainer.serving.agent_loop import served_agent_loop  # lazy: it imports this package

        rollout.agent_loop = served_agent_loop(config.multi_turn, rollout.tokenizer, rollout.eos_token_ids)
    elif config.multi_turn.enable:
        rollout.agent_loop = AgentLoop(config.multi_turn, rollout.tokenizer, rollout.eos_token_ids)
        warn_if_no_call_fits(rollout.agent_loop.tools.values(), rollout.tokenizer, config.max_new_tokens,
                             config.multi_turn.tool_call_format)
    return rollout
