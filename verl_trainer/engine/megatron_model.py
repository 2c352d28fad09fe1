"""The Megatron-Core model of a HF checkpoint: its process groups, ``TransformerConfig`` and ``GPTModel``.

:func:`megatron_groups` hands Megatron the engine's own process groups (``engine/topology.py``: the
``(dp, tp)`` mesh) as a ``ProcessGroupCollection``, so every Megatron module and the DDP wrapper of one
engine carry that engine's groups explicitly; Megatron's process-global ``parallel_state`` is never
initialised, and several engines (actor and reference, or one invariance case after another with another
layout) live side by side in one process.

:func:`build_gpt_model` builds ``GPTModel`` from the HF config through mbridge's config mapping
(``megatron_bridge.py``), with Megatron's local layer spec (plain torch modules) or, where Transformer
Engine is installed on a CUDA machine, the TE spec. Supported architectures: :data:`SUPPORTED_ARCHITECTURES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from verl_trainer.engine.topology import Topology

__all__ = ["SUPPORTED_ARCHITECTURES", "MegatronGroups", "build_gpt_model", "check_hf_config",
           "megatron_groups", "padded_vocab_size", "rope_theta", "uses_transformer_engine"]

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3_moe")
"""HF ``model_type`` values the engine builds (decoders with RMSNorm, SwiGLU and RoPE; Qwen3-MoE's MoE
layers are Megatron's ``MoELayer``: ``engine/megatron_moe.py``)."""

_SINGLETONS: dict[int, tuple[Any, Any]] = {}  # id(WORLD) -> (WORLD, 1-rank group); -ep -> (WORLD, groups)


@dataclass(frozen=True)
class MegatronGroups:
    """One engine's process groups as Megatron sees them.

    Attributes:
        collection: Megatron's ``ProcessGroupCollection`` (``tp``, ``dp``, 1-rank ``pp`` / ``cp`` / ``ep``).
        tp_group: The tensor-parallel group (one rank without TP).
        tp_rank: This rank's place in it.
        tp_size: Its size.
        ep_size: Expert-parallel size (``collection.ep`` has this many ranks; 1 = experts replicated).
    """

    collection: ProcessGroupCollection
    tp_group: dist.ProcessGroup
    tp_rank: int
    tp_size: int
    ep_size: int = 1


def _alive(group: dist.ProcessGroup) -> bool:
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):  # destroyed since (e.g. by a test harness)
        return False
    return True


def _single_rank_group() -> dist.ProcessGroup:
    """This rank's 1-rank group, created once while it lives (every rank creates all of them together)."""
    world = dist.group.WORLD
    cached = _SINGLETONS.get(id(world))
    if cached is None or cached[0] is not world or not _alive(cached[1]):
        group, _ = dist.new_subgroups(group_size=1)
        _SINGLETONS.clear()
        _SINGLETONS[id(world)] = cached = (world, group)
    return cached[1]


def _expert_groups(ep: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's EP group (``ep`` adjacent ranks) and expert-data-parallel group (the ranks of its EP rank).

    Created once per ``ep`` while the process group lives (every rank creates all of them together);
    without TP only (``megatron_moe.check_expert_parallel``).
    """
    world = dist.group.WORLD
    cached = _SINGLETONS.get(-ep)  # beside _single_rank_group's entry
    if cached is None or cached[0] is not world or not _alive(cached[1][0]):
        size = dist.get_world_size()
        ep_group, _ = dist.new_subgroups_by_enumeration(
            [list(range(start, start + ep)) for start in range(0, size, ep)])
        expt_dp, _ = dist.new_subgroups_by_enumeration(
            [list(range(offset, size, ep)) for offset in range(ep)])
        _SINGLETONS[-ep] = cached = (world, (ep_group, expt_dp))
    return cached[1]


def megatron_groups(topology: Topology, ep: int = 1) -> MegatronGroups:
    """The ``ProcessGroupCollection`` of ``topology`` (a collective the first time in a process group).

    TP ranks are adjacent (``rank = dp_rank * tp + tp_rank``), as Megatron's own default order places them.
    ``ep > 1`` (no TP): EP groups of ``ep`` adjacent dp ranks; the experts' data-parallel group holds the
    ranks with the same experts.
    """
    single = _single_rank_group()
    tp_group = topology.tp_mesh.get_group() if topology.tp_mesh is not None else single
    dp_group = topology.dp_group if topology.dp_group is not None else single
    ep_group, expt_dp = _expert_groups(ep) if ep > 1 else (single, dp_group)
    tp_ep = ep_group if ep > 1 else tp_group
    collection = ProcessGroupCollection(
        tp=tp_group, pp=single, mp=tp_group, cp=single, tp_cp=tp_group, embd=None, pos_embd=None,
        ep=ep_group, expt_tp=single, tp_ep=tp_ep, tp_ep_pp=tp_ep, dp=dp_group, dp_cp=dp_group,
        expt_dp=expt_dp, intra_expt_dp=expt_dp, intra_dp_cp=dp_group, tp_dp_cp=dist.group.WORLD,
    )
    return MegatronGroups(collection, tp_group, topology.tp_rank, topology.tp_size, ep)


def uses_transformer_engine(device_type: str) -> bool:
    """Whether the TE layer spec is used: on CUDA with ``transformer_engine`` importable."""
    if device_type != "cuda":
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def rope_theta(hf_config: PretrainedConfig) -> float:
    """RoPE's base: ``rope_parameters["rope_theta"]`` (transformers 5) or the older ``rope_theta``."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else getattr(hf_config, "rope_theta", 10000.0))


def _rope_type(hf_config: PretrainedConfig) -> str:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return "default"
    return str(params.get("rope_type", params.get("type", "default")))


def check_hf_config(hf_config: PretrainedConfig, tp: int, device_type: str) -> None:
    """Refuse a model the engine cannot build exactly (before any weight is read; the same on every rank).

    Raises:
        ValueError: Naming the architecture or setting, the supported ones and the fix.
    """
    arch = getattr(hf_config, "model_type", None)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"the megatron engine builds {SUPPORTED_ARCHITECTURES} models, got model_type={arch!r}; use "
            f"strategy='fsdp2' (any HF causal LM) for this model"
        )
    rope = _rope_type(hf_config)
    if rope != "default":
        raise ValueError(f"the megatron engine supports default RoPE only, this {arch} model has "
                         f"rope_type={rope!r}; use strategy='fsdp2' for it")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError(f"the megatron engine has no sliding-window attention ({arch} with "
                         f"use_sliding_window=True); use strategy='fsdp2' for it")
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError(f"the megatron engine maps no MLP biases ({arch} with mlp_bias=True); use "
                         f"strategy='fsdp2' for it")
    dropout = max(float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
                  float(getattr(hf_config, "hidden_dropout", 0.0) or 0.0))
    if device_type == "cpu" and dropout > 0:
        raise ValueError(
            f"the megatron engine on CPU runs Megatron's no-op RNG tracker, which is exact only without "
            f"dropout; this model has dropout {dropout}: set attention_dropout=0 in its config.json, or run "
            f"on CUDA"
        )
    sparse_step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    if getattr(hf_config, "mlp_only_layers", None) or sparse_step != 1:
        raise ValueError(f"the megatron engine builds {arch} with every layer a MoE layer; this model has "
                         f"mlp_only_layers={hf_config.mlp_only_layers} / decoder_sparse_step="
                         f"{hf_config.decoder_sparse_step}; use strategy='fsdp2' for it")
    heads, groups = int(hf_config.num_attention_heads), int(hf_config.num_key_value_heads)
    for name, size in (("num_attention_heads", heads), ("num_key_value_heads", groups),
                       ("intermediate_size", int(hf_config.intermediate_size))):
        if size % tp:
            valid = [d for d in range(1, groups + 1) if heads % d == 0 and groups % d == 0
                     and int(hf_config.intermediate_size) % d == 0]
            raise ValueError(f"{name}={size} of the {arch} model is not divisible by "
                             f"tensor_model_parallel_size={tp}; choose a TP size from {valid}")


def padded_vocab_size(vocab: int, tp: int) -> int:
    """The output layer's rows: ``vocab`` rounded up to a multiple of ``tp`` (Megatron splits it evenly)."""
    return -(-vocab // tp) * tp


def cpu_config_overrides(device_type: str, dtype: torch.dtype, recompute: bool = False) -> dict[str, Any]:
    """``TransformerConfig`` fields the engine sets over mbridge's mapping.

    Weights are initialised (on CPU for a CPU engine), then read from the checkpoint; fused kernels only with
    Transformer Engine; no Megatron sequence parallelism (the engine's rows are ``[b, s]``); the engine's
    dtype; ``recompute``: Megatron's full recompute of every layer (gradient checkpointing).
    """
    te = uses_transformer_engine(device_type)
    checkpointing = {"recompute_granularity": "full", "recompute_method": "uniform",
                     "recompute_num_layers": 1}
    return {**(checkpointing if recompute else {}),
        "use_cpu_initialization": device_type == "cpu",
        # initialised, then overwritten by the checkpoint: Megatron's TP layers set their tensor-parallel
        # attributes (which shard is which) only inside their initialisation
        "perform_initialization": True,
        "sequence_parallel": False,
        "masked_softmax_fusion": te,
        "bias_activation_fusion": te,
        "bias_dropout_fusion": te,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "persist_layer_norm": False,
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        "bf16": False,
        "fp16": False,
    }


def build_gpt_model(bridge: Any, hf_config: PretrainedConfig, groups: MegatronGroups,
                    device: torch.device) -> GPTModel:
    """``GPTModel`` (embedding, decoder and output layer on this rank) for the bridge's ``TransformerConfig``.

    Args:
        bridge: The mbridge bridge of the model (``megatron_bridge.make_bridge``).
        hf_config: The HF config.
        groups: The engine's Megatron groups.
        device: Where the parameters live.
    """
    config = bridge.config
    if uses_transformer_engine(device.type):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                        qk_layernorm=config.qk_layernorm, normalization=config.normalization)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    with torch.device(device):
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=padded_vocab_size(int(hf_config.vocab_size), groups.tp_size),
            max_sequence_length=int(hf_config.max_position_embeddings),
            pre_process=True,
            post_process=True,
            parallel_output=True,
            share_embeddings_and_output_weights=tied,
            position_embedding_type="rope",
            rotary_base=rope_theta(hf_config),
            pg_collection=groups.collection,
        )
    from megatron.core import tensor_parallel

    for param in model.parameters():  # what Megatron's own model builders do: every param gets TP attributes
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    return model
