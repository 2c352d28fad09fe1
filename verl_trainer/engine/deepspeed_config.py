"""The DeepSpeed config dict the ``deepspeed`` engine generates from the typed engine configs.

:func:`build_deepspeed_config` maps :class:`~verl_trainer.engine.config.EngineConfig` and
:class:`~verl_trainer.engine.config.OptimConfig` onto a DeepSpeed config (a dict, no json file), then
merges ``EngineConfig.deepspeed_config`` over it and rejects what would break the engine's contract:
``gradient_accumulation_steps`` other than 1, an ``optimizer`` or ``scheduler`` section (they come from
``OptimConfig``), a ZeRO stage other than ``zero_stage``. ``gradient_clipping`` is ``OptimConfig.clip_grad``
(ZeRO clips by the global norm and skips a step whose norm is not finite).
"""

from __future__ import annotations

import copy
from typing import Any

from verl_trainer.engine.config import EngineConfig, OptimConfig, to_dtype

_DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}
_FORBIDDEN_SECTIONS = ("optimizer", "scheduler")
_NEVER_PRINT = 2**31 - 1


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``base`` with ``override`` merged in recursively (override wins on leaves)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _dtype_name(name: str) -> str:
    return _DTYPE_NAMES[str(to_dtype(name))]


def _precision_sections(config: EngineConfig) -> dict[str, Any]:
    """``bf16`` / ``fp16`` sections for mixed precision (fp32 master weights in the ZeRO optimizer)."""
    param = _dtype_name(config.param_dtype)
    out: dict[str, Any] = {"bf16": {"enabled": param == "bf16"}, "fp16": {"enabled": param == "fp16"}}
    reduce = _dtype_name(config.reduce_dtype)
    if param != "fp32" and reduce != param:
        out["communication_data_type"] = reduce
    return out


def _offload_sections(config: EngineConfig, device_type: str) -> dict[str, Any]:
    """DeepSpeed's own CPU offload for ``param_offload`` / ``optimizer_offload`` (nothing on CPU).

    Raises:
        ValueError: ``param_offload`` without ZeRO stage 3 (DeepSpeed offloads parameters only there).
    """
    if config.param_offload and config.zero_stage != 3:
        raise ValueError(
            f"param_offload=True needs zero_stage=3 with the deepspeed backend (got zero_stage="
            f"{config.zero_stage}); DeepSpeed offloads parameters only in ZeRO-3. Use "
            f"backend='deepspeed_stage_3' or set optimizer_offload=True only"
        )
    zero: dict[str, Any] = {}
    if device_type == "cpu":  # already on the host: nothing to offload to
        return zero
    if config.optimizer_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if config.param_offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return zero


def build_deepspeed_config(
    config: EngineConfig,
    optim_config: OptimConfig | None,
    world_size: int,
    device_type: str = "cpu",
) -> dict[str, Any]:
    """The DeepSpeed config for one engine.

    Args:
        config: Engine config (``zero_stage``, ``micro_batch_size_per_gpu``, dtypes, offload, and the
            raw ``deepspeed_config`` merged on top).
        optim_config: Supplies ``gradient_clipping``; ``None`` for an inference-only engine, which
            runs ZeRO-3 for ``zero_stage=3`` and no ZeRO otherwise.
        world_size: Data-parallel world size (DeepSpeed checks ``train_batch_size`` against it).
        device_type: ``"cpu"``, ``"cuda"`` or ``"npu"``; offload sections are only added off CPU.

    Returns:
        A config dict for ``deepspeed.initialize(config=...)``.

    Raises:
        ValueError: If the raw config sets ``gradient_accumulation_steps`` other than 1, adds an
            ``optimizer`` / ``scheduler`` section, or names a ZeRO stage other than ``zero_stage``.
    """
    clip = optim_config.clip_grad if optim_config is not None and (optim_config.clip_grad or 0) > 0 else 0.0
    mbs = config.micro_batch_size_per_gpu
    # ZeRO-1/2 shard only optimizer state and gradients: an inference-only engine runs without ZeRO
    # (DeepSpeed refuses ZeRO-1/2 without an optimizer); ZeRO-3 still partitions its parameters.
    stage = config.zero_stage if optim_config is not None or config.zero_stage == 3 else 0
    zero = {"stage": stage, **_offload_sections(config, device_type)}
    generated: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": mbs,
        # the engine drives the micro-batches (their count varies with dynamic batching) and marks the last;
        # more accumulation steps would divide each loss, already a partial sum over global denominators
        "gradient_accumulation_steps": 1,
        "train_batch_size": mbs * world_size,
        "gradient_clipping": float(clip or 0.0),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": _NEVER_PRINT,
        "wall_clock_breakdown": False,
        **_precision_sections(config),
    }
    if config.optimizer_offload and device_type != "cpu":
        generated["zero_force_ds_cpu_optimizer"] = False  # we hand DeepSpeed a torch optimizer
    raw = dict(config.deepspeed_config or {})
    bad = [k for k in _FORBIDDEN_SECTIONS if k in raw]
    if bad:
        raise ValueError(
            f"deepspeed_config may not set {bad}: the deepspeed engine builds AdamW and the LR schedule "
            f"from OptimConfig; set OptimConfig fields (lr, betas, weight_decay, lr_scheduler, ...) instead"
        )
    merged = deep_merge(generated, raw)
    if merged["gradient_accumulation_steps"] != 1:
        raise ValueError(
            f"deepspeed_config.gradient_accumulation_steps={merged['gradient_accumulation_steps']} is not "
            f"supported: the engine runs the micro-batches of a step itself (micro_batch_size_per_gpu / "
            f"use_dynamic_bsz) and DeepSpeed would divide each loss by that count; remove the key"
        )
    raw_stage = raw.get("zero_optimization", {}).get("stage", config.zero_stage)
    if raw_stage != config.zero_stage:
        raise ValueError(
            f"deepspeed_config.zero_optimization.stage={raw_stage} contradicts EngineConfig.zero_stage="
            f"{config.zero_stage}; set the stage with zero_stage (or the deepspeed_stage_N backend)"
        )
    merged["zero_optimization"]["stage"] = stage
    merged["train_batch_size"] = merged["train_micro_batch_size_per_gpu"] * world_size
    return merged
