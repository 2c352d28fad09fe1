"""The model an engine shards: the user's model factory or the checkpoint, varlen attention, then LoRA.

:func:`build_model` is what every backend's ``initialize`` calls (through ``BaseEngine.build_model``)
before it shards the model. LoRA code (``engine/lora.py``, peft) is entered only when the config asks for
adapters or a factory's model may carry them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verl_trainer.engine.config import EngineConfig
from verl_trainer.engine.heads import ModelType, attention_for
from verl_trainer.engine.lora import LoRAAdapters, apply_lora, find_peft_model
from verl_trainer.models.attention import ensure_varlen_attention
from verl_trainer.models.attention_autotune import agree_on_model_attention
from verl_trainer.models.ulysses_attention import check_ulysses_compatible
from verl_trainer.models.vlm import check_vlm_settings, freeze_vision_tower, is_vision_language
from verl_trainer.utils.device import get_torch_device
from verl_trainer.utils.distributed import get_world_size, is_initialized

ModelFactory = Callable[[], torch.nn.Module]
"""A zero-argument callable returning the model (a transformers model or ``PeftModel``)."""


def _from_factory(factory: ModelFactory, config: EngineConfig) -> torch.nn.Module:
    """The factory's model with the engine's attention (and its heads checked against the SP size)."""
    model = factory()
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(
            f"the model factory must return a transformers model or PeftModel (an nn.Module with "
            f".config and the HF forward), got {type(model).__name__}"
        )
    model = ensure_varlen_attention(model, attention_for(config))
    sp = config.ulysses_sequence_parallel_size
    if sp > 1:
        check_ulysses_compatible(model.config, sp, get_world_size() if is_initialized() else None)
    return model


def _agree_on_attention(model: torch.nn.Module, config: EngineConfig) -> None:
    """Choose the CPU attention path for the model's layout on every rank together (one collective)."""
    split = config.ulysses_sequence_parallel_size * config.tensor_model_parallel_size
    agree_on_model_attention(model.config, get_torch_device(), split)


def build_model(
    config: EngineConfig, model_type: ModelType, factory: ModelFactory | None = None
) -> tuple[torch.nn.Module, LoRAAdapters | None]:
    """The model to shard and, when it carries adapters, its LoRA part.

    Args:
        config: The engine config (``model_path``, the LoRA fields, the SP size).
        model_type: Loads the checkpoint when there is no factory.
        factory: The user's model factory (``EngineSpec.model``), or ``None``.

    Returns:
        ``(model, lora)``: ``lora`` is ``None`` for a model without adapters.
    """
    if factory is None:
        model = model_type.load(config)
    else:
        model = _from_factory(factory, config)
    _agree_on_attention(model, config)
    vision_language = is_vision_language(getattr(model, "config", None))
    check_vlm_settings(config.model_path, vision_language, config.ulysses_sequence_parallel_size,
                       config.freeze_vision_tower, config.tensor_model_parallel_size,
                       config.pipeline_model_parallel_size)  # a factory's model: known only now
    if vision_language and config.freeze_vision_tower:
        freeze_vision_tower(model)
    if factory is None and not config.lora_enabled:
        return model, None
    model = apply_lora(model, config, model_type.name)
    peft_model = find_peft_model(model)
    return model, None if peft_model is None else LoRAAdapters(peft_model)
