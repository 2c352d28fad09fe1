"""What the Megatron engine does not run, refused at construction (before any model loads), with the fix."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from verl_trainer.engine.config import EngineConfig
from verl_trainer.models.hf_files import to_dtype

__all__ = ["check_megatron_request"]

OTHER_BACKENDS = "strategy='fsdp2' (or 'fsdp' / 'deepspeed')"


def check_megatron_request(config: EngineConfig, model_type: str, model_factory: Callable[[], Any] | None,
                           device_type: str) -> None:
    """Raise ``ValueError`` for a request the Megatron engine cannot run; the same on every rank.

    Refused: a value model, LoRA, Ulysses SP, a model factory, a model without ``model_path``, parameter
    offload, float16 compute, mixed precision, gradient checkpointing on CPU.
    """
    if model_type != "language_model":
        raise ValueError(
            f"the megatron engine builds language models only, got model_type={model_type!r}: GPTModel sizes "
            f"its output layer and its embedding by one vocab_size, so a scalar value head would need a "
            f"replaced output layer; use {OTHER_BACKENDS} for the critic / value model"
        )
    if config.lora_enabled:
        raise ValueError(f"LoRA is not supported by the megatron engine (lora_rank={config.lora_rank}); use "
                         f"{OTHER_BACKENDS}, which apply peft adapters, or set lora_rank=0")
    if config.ulysses_sequence_parallel_size > 1:
        raise ValueError(
            f"ulysses_sequence_parallel_size={config.ulysses_sequence_parallel_size} is not supported by the "
            f"megatron engine; use {OTHER_BACKENDS} for Ulysses SP, or tensor_model_parallel_size with "
            f"megatron"
        )
    if model_factory is not None:
        raise ValueError("the megatron engine builds GPTModel from a HF checkpoint directory "
                         "(EngineConfig.model_path), not from a model factory; save the model with "
                         "save_pretrained and pass its path")
    if not config.model_path:
        raise ValueError("the megatron engine needs EngineConfig.model_path (a HF checkpoint directory)")
    if config.param_offload:
        raise ValueError("param_offload is not supported by the megatron engine (its DDP gradient buffers "
                         "stay on the device); set param_offload=False or use " + OTHER_BACKENDS)
    compute, weights = to_dtype(config.param_dtype), to_dtype(config.model_dtype)
    if torch.float16 in (compute, weights):
        raise ValueError("float16 (precision='16-mixed') is not supported by the megatron engine (no loss "
                         "scaler on Megatron's gradient buffers); use precision='bf16-true' or '32-true'")
    if compute != weights:
        raise ValueError(
            f"the megatron engine computes in the weights' dtype: param_dtype={config.param_dtype!r} differs "
            f"from model_dtype={config.model_dtype!r} (mixed precision with fp32 master weights is "
            f"Megatron's distributed optimizer, which is not wired here); use precision='32-true' or "
            f"'bf16-true' "
            f"(param_dtype = model_dtype), or {OTHER_BACKENDS}"
        )
    if config.enable_gradient_checkpointing and device_type == "cpu":
        raise ValueError("gradient checkpointing with the megatron engine uses Megatron's recompute, which "
                         "saves CUDA RNG states; it does not run on CPU: set "
                         "enable_gradient_checkpointing=False")
