"""Torchtitan's parallelisation of an engine's model: its ``ParallelDims`` mesh and its parallelize function.

:func:`parallelism_config` turns the engine config into torchtitan's ``ParallelismConfig`` (FSDP over every
rank not in TP, TP of ``tensor_model_parallel_size`` without sequence parallelism, DTensor on the
model-parallel axes only: ``spmd_backend="partial_dtensor"``); the model config reads it before the model
is built (``update_from_config`` sets the TP sharding plan). :func:`parallelize` then builds the mesh and
runs the model's own parallelize function (``parallelize_llama`` / ``parallelize_qwen3``: TP, activation
checkpointing, FSDP2 per block) and sets FSDP's gradient reduction to the mean over the data-parallel ranks.

Why the mean: torchtitan sets every FSDP module's gradient divide factor to 1 (a sum) because its own loss
divides by the global token count. The engine's losses (``core_algos.aggregation``) already carry the
``x dp`` factor that a mean over dp cancels, as under fsdp2, so the divide factor is set back to ``dp``
(``ReduceOp.AVG``, which gloo and NCCL both have; gloo has no ``PREMUL_SUM``, which a factor of 1 at
``dp > 1`` would use).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.activation_checkpoint import FullAC

from verl_trainer.engine.config import EngineConfig
from verl_trainer.engine.torchtitan_cpu import mesh_device_type
from verl_trainer.models.hf_files import to_dtype

_PARAM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class _ParallelismHolder:
    """What torchtitan's ``Config.update_from_config`` reads outside its trainer: ``.parallelism``."""

    parallelism: ParallelismConfig


def parallelism_config(config: EngineConfig) -> ParallelismConfig:
    """Torchtitan's parallelism settings for ``config`` (dp: every rank outside TP)."""
    return ParallelismConfig(
        data_parallel_shard_degree=-1,
        tensor_parallel_degree=config.tensor_model_parallel_size,
        expert_parallel_degree=config.expert_model_parallel_size,
        enable_sequence_parallel=False,
        spmd_backend="partial_dtensor",
        fsdp_reshard_after_forward="always" if config.reshard_after_forward else "never",
    )


def training_config(config: EngineConfig) -> TrainingConfig:
    """Torchtitan's FSDP precision / offload settings for ``config``.

    Raises:
        ValueError: ``param_dtype`` other than float32 / bfloat16, or ``reduce_dtype`` other than float32
            (torchtitan's ``TrainingConfig`` takes only those).
    """
    param = to_dtype(config.param_dtype)
    if param not in _PARAM_DTYPES:
        raise ValueError(
            f"param_dtype={config.param_dtype!r}: strategy='torchtitan' takes param_dtype in "
            f"{sorted(_PARAM_DTYPES.values())} (torchtitan's mixed_precision_param); set one of them"
        )
    if to_dtype(config.reduce_dtype) != torch.float32:
        raise ValueError(
            f"reduce_dtype={config.reduce_dtype!r}: strategy='torchtitan' reduces gradients in float32 "
            f"(torchtitan's mixed_precision_reduce); set reduce_dtype='float32'"
        )
    return TrainingConfig(mixed_precision_param=_PARAM_DTYPES[param], mixed_precision_reduce="float32",
                          enable_cpu_offload=config.fsdp_cpu_offload)


def prepare_model_config(model_config: Any, parallelism: ParallelismConfig) -> None:
    """Let torchtitan's model config read the parallelism (TP sharding plan, head-count checks)."""
    model_config.update_from_config(config=_ParallelismHolder(parallelism))


def parallelize(model: torch.nn.Module, parallelize_fn: Any, config: EngineConfig, world_size: int,
                device_type: str, scratch_dir: str) -> ParallelDims:
    """Shard ``model`` in place with torchtitan's ``parallelize_fn``; returns its ``ParallelDims``.

    Args:
        model: The torchtitan model holding the full weights (the same on every rank).
        parallelize_fn: ``parallelize_llama`` / ``parallelize_qwen3``.
        config: The engine config (TP size, precision, resharding, offload, activation checkpointing).
        world_size: All ranks.
        device_type: ``"cpu"`` or ``"cuda"`` (the mesh's).
        scratch_dir: torchtitan's ``dump_folder`` (read by its activation-checkpointing debug output).
    """
    parallelism = parallelism_config(config)
    # what torchtitan's Trainer sets at start: the MoE token dispatcher reads it at run time (process-wide;
    # every engine of this backend uses the same value)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    dims = ParallelDims.from_config(parallelism, world_size)
    with mesh_device_type(device_type):
        dims.build_mesh()
    ac = FullAC.Config() if config.enable_gradient_checkpointing else None
    parallelize_fn(model, parallel_dims=dims, training=training_config(config), parallelism=parallelism,
                   compile_config=CompileConfig(), ac_config=ac, dump_folder=scratch_dir)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(dims.dp_shard))
    return dims
