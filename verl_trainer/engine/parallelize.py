"""Sharding part: wrap a HF model with FSDP2 (``fully_shard``) or FSDP1, one unit per decoder layer.

Both shard over the engine's 1-D ``shard_mesh`` (all ranks); the decoder-layer classes come from
``config.wrap_modules`` or the model's ``_no_split_modules``.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from verl_trainer.engine.config import EngineConfig, to_dtype


def wrap_module_classes(model: torch.nn.Module, names: list[str] | None = None) -> set[type]:
    """Find the classes of ``model``'s submodules that become their own FSDP unit.

    Args:
        model: The HF model.
        names: Class names to wrap; default ``model._no_split_modules`` (its decoder layer).

    Raises:
        ValueError: If a name matches no submodule.

    """
    wanted = list(names if names is not None else (getattr(model, "_no_split_modules", None) or []))
    found = {type(m) for m in model.modules() if type(m).__name__ in wanted}
    missing = sorted(set(wanted) - {c.__name__ for c in found})
    if missing:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"wrap_modules {missing} match no submodule of {type(model).__name__}; "
            f"module classes present: {present}"
        )
    return found


def apply_fsdp2(model: torch.nn.Module, mesh: DeviceMesh, config: EngineConfig) -> torch.nn.Module:
    """``fully_shard`` every decoder layer, then the root, with the config's precision and offload.

    Args:
        model: The HF model (on CPU or the device; FSDP2 moves shards to the mesh device).
        mesh: 1-D mesh to shard over.
        config: ``param_dtype``, ``reduce_dtype``, ``reshard_after_forward``, ``fsdp_cpu_offload``,
            ``wrap_modules``.

    Returns:
        The same object, now an ``FSDPModule`` (its class and parameter names are unchanged).

    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp_policy = MixedPrecisionPolicy(
        param_dtype=to_dtype(config.param_dtype),
        reduce_dtype=to_dtype(config.reduce_dtype),
        cast_forward_inputs=True,
    )
    offload = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        if config.fsdp_cpu_offload
        else OffloadPolicy()
    )
    kwargs = {"mesh": mesh, "mp_policy": mp_policy, "offload_policy": offload}
    classes = tuple(wrap_module_classes(model, config.wrap_modules))
    for module in model.modules():
        if classes and isinstance(module, classes):
            fully_shard(module, reshard_after_forward=config.reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=config.reshard_after_forward, **kwargs)
    return model


def apply_fsdp1(
    model: torch.nn.Module, mesh: DeviceMesh, config: EngineConfig, device: torch.device
) -> torch.nn.Module:
    """Wrap with FSDP1 (``use_orig_params=True``, so parameter names and the optimizer see HF params).

    Args:
        model: The HF model on CPU.
        mesh: 1-D mesh to shard over (FSDP1's sharded state dict then uses DTensor).
        config: ``param_dtype``, ``reduce_dtype``, ``model_dtype``, ``reshard_after_forward``,
            ``fsdp_cpu_offload``, ``wrap_modules``.
        device: The compute device.

    Returns:
        The ``FullyShardedDataParallel`` wrapper.

    """
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    classes = wrap_module_classes(model, config.wrap_modules)
    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy(classes) if classes else None,
        sharding_strategy=(
            ShardingStrategy.FULL_SHARD if config.reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP
        ),
        mixed_precision=MixedPrecision(
            param_dtype=to_dtype(config.param_dtype),
            reduce_dtype=to_dtype(config.reduce_dtype),
            buffer_dtype=to_dtype(config.model_dtype),
        ),
        cpu_offload=CPUOffload(offload_params=config.fsdp_cpu_offload),
        device_id=device,
        device_mesh=mesh,
        use_orig_params=True,
        sync_module_states=False,
    )
