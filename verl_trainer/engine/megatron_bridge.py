"""HF weights in and out of a Megatron ``GPTModel`` through mbridge (its config and weight mapping).

mbridge (0.15) maps a HF config to a ``TransformerConfig`` and HF tensors to Megatron's (fused QKV, fused
gate/up, TP splits) and back. Three gaps are closed here, in a subclass of the model's own bridge class
(:func:`make_bridge`), not in mbridge:

* its names assume Transformer Engine's fused layer norms (``linear_qkv.layer_norm_weight``,
  ``linear_fc1.layer_norm_weight``); Megatron's local spec (CPU) has ``input_layernorm`` /
  ``pre_mlp_layernorm``: they are renamed before the mapping (:data:`LOCAL_SPEC_NAMES`);
* it reads the process groups from Megatron's global ``parallel_state``: the bridge gets the engine's own
  (``ParallelStates`` built from ``megatron_model.MegatronGroups``);
* its export broadcasts every tensor over the global pipeline group (and allocates on CUDA for it); the
  engine has no PP, so :func:`hf_tensors` gathers each TP-split tensor over the engine's TP group and
  converts it with the bridge's own merge and format functions.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from mbridge import AutoBridge
from mbridge.core.bridge import _MODEL_REGISTRY
from mbridge.core.parallel_states import ParallelStates

from verl_trainer.engine.megatron_model import cpu_config_overrides, padded_vocab_size
from verl_trainer.engine.megatron_moe import ExpertFuser, fused_expert_name, is_moe, moe_config_overrides

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from transformers import PretrainedConfig

    from verl_trainer.engine.megatron_model import MegatronGroups

__all__ = ["LOCAL_SPEC_NAMES", "hf_tensors", "load_hf_weights", "make_bridge"]

LOCAL_SPEC_NAMES = (
    (re.compile(r"\.input_layernorm\.weight$"), ".self_attention.linear_qkv.layer_norm_weight"),
    (re.compile(r"\.pre_mlp_layernorm\.weight$"), ".mlp.linear_fc1.layer_norm_weight"),
)
"""Megatron local-spec parameter names -> the TE names mbridge's mappings are written for."""


def is_local_expert(name: str) -> bool:
    """Whether ``name`` is a ``SequentialMLP`` expert weight (``...mlp.experts.local_experts.{i}...``)."""
    return _LOCAL_EXPERT.search(name) is not None


def _ep_gathered(bridge: Any, local_name: str, value: torch.Tensor, groups: MegatronGroups,
                 fuser: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """An expert weight of every EP rank (all-gathered over the EP group), as HF tensors; an EP collective."""
    parts = [torch.empty_like(value) for _ in range(groups.ep_size)]
    dist.all_gather(parts, value.contiguous(), group=groups.collection.ep)
    per_rank = int(bridge.config.num_moe_experts) // groups.ep_size
    for rank, part in enumerate(parts):
        global_name = grouped_expert_name(local_name, rank * per_rank)
        out_names, out_tensors = bridge._weight_to_hf_format(te_name(global_name, True), part)
        for name, tensor in zip(out_names, out_tensors):
            yield from fuser.add(name, tensor.contiguous())


_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def te_name(name: str, moe: bool = False) -> str:
    """``name`` with the local spec's layer-norm names replaced by TE's (other names unchanged).

    ``moe``: a MoE layer keeps ``pre_mlp_layernorm`` (TE does not fuse it into the router; mbridge's MoE
    mappings name it so).
    """
    for pattern, replacement in LOCAL_SPEC_NAMES[:1] if moe else LOCAL_SPEC_NAMES:
        name = pattern.sub(replacement, name)
    return name


def grouped_expert_name(name: str, offset: int = 0) -> str:
    """A ``SequentialMLP`` expert's name as TE's grouped-GEMM name that mbridge maps (global expert id).

    ``...mlp.experts.local_experts.{i}.linear_fc1.weight`` -> ``...mlp.experts.linear_fc1.weight{i + offset}``
    (``offset``: the first global expert of this EP rank); other names unchanged.
    """
    return _LOCAL_EXPERT.sub(lambda m: f".mlp.experts.{m.group(2)}.weight{int(m.group(1)) + offset}", name)


def make_bridge(hf_config: PretrainedConfig, groups: MegatronGroups, dtype: torch.dtype,
                device_type: str, recompute: bool = False) -> Any:
    """The mbridge bridge of ``hf_config`` on the engine's groups, with the engine's config overrides.

    ``recompute``: Megatron's full activation recompute of every layer (gradient checkpointing).

    Raises:
        ValueError: mbridge has no bridge for the architecture.
    """
    arch = hf_config.model_type
    if arch not in _MODEL_REGISTRY:
        raise ValueError(f"mbridge has no bridge for model_type={arch!r}; it has "
                         f"{AutoBridge.list_supported_models()}")
    base = _MODEL_REGISTRY[arch]
    moe = is_moe(hf_config)
    overrides = {**cpu_config_overrides(device_type, dtype, recompute),
                 **moe_config_overrides(hf_config, device_type, groups.ep_size)}
    ep_rank = dist.get_rank(groups.collection.ep) if groups.ep_size > 1 else 0

    class EngineBridge(base):  # type: ignore[misc,valid-type]
        def _build_base_config(self, text_config_key: str | None = None, **kwargs: Any) -> Any:
            return super()._build_base_config(text_config_key, **{**kwargs, **overrides})

        def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name: str) -> list[str]:
            return super()._weight_name_mapping_mcore_to_hf(te_name(mcore_weights_name, moe))

        def _weight_name_mapping_mcore_local_to_global(self, model: Any, consider_ep: bool = True
                                                       ) -> dict[str, str]:
            names = super()._weight_name_mapping_mcore_local_to_global(model, consider_ep=False)
            offset = ep_rank * (int(self.config.num_moe_experts or 0) // groups.ep_size)  # first expert
            return {local: grouped_expert_name(name, offset) for local, name in names.items()}

    states = ParallelStates(tp_size=groups.tp_size, tp_rank=groups.tp_rank, tp_group=groups.tp_group,
                            pp_group=groups.collection.pp, cp_group=groups.collection.cp,
                            ep_size=groups.ep_size, ep_rank=ep_rank,
                            ep_group=groups.collection.ep, etp_group=groups.collection.expt_tp, vpp_size=None)
    bridge = EngineBridge(hf_config, dtype=dtype, parallel_states=states)
    bridge.is_moe = moe
    vocab = int(hf_config.vocab_size)
    padded = padded_vocab_size(vocab, groups.tp_size)
    bridge.vocab_size, bridge.padded_vocab_size = vocab, padded
    bridge.make_vocab_size_divisible_by = groups.tp_size if padded != vocab else None
    return bridge


def load_hf_weights(bridge: Any, model: GPTModel, path: str) -> None:
    """Read the HF safetensors of ``path`` into ``model`` (mbridge's ``load_weights``); a TP collective."""
    with torch.no_grad():
        bridge.load_weights([model], path)


def hf_tensors(bridge: Any, model: GPTModel, groups: MegatronGroups,
               keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` of ``model``, one parameter at a time; a TP collective.

    Every TP rank must iterate to the end (a TP-split parameter is all-gathered when reached). A parameter
    is skipped, on every rank alike, when ``keep`` accepts none of its HF names.
    """
    names = bridge._weight_name_mapping_mcore_local_to_global(model)
    fuser = ExpertFuser(int(bridge.config.num_moe_experts or 0)) if bridge.is_moe else None
    for local_name, param in model.named_parameters():
        global_name = names[local_name]
        hf_names = bridge._weight_name_mapping_mcore_to_hf(global_name)
        public = [fused_expert_name(n) or n for n in hf_names]  # MoE: transformers 5's fused names
        if keep is not None and not any(keep(n) for n in public):
            continue
        value = param.detach()
        if groups.ep_size > 1 and is_local_expert(local_name):  # every EP rank's experts, in global order
            yield from _ep_gathered(bridge, local_name, value, groups, fuser)
            continue
        if groups.tp_size > 1 and getattr(param, "tensor_model_parallel", False):
            parts = [torch.empty_like(value) for _ in range(groups.tp_size)]
            dist.all_gather(parts, value.contiguous(), group=groups.tp_group)
            value = bridge._weight_merge_across_tp(te_name(global_name, bridge.is_moe), parts, param)
        out_names, out_tensors = bridge._weight_to_hf_format(te_name(global_name, bridge.is_moe), value)
        for name, tensor in zip(out_names, out_tensors):
            if fuser is not None and fused_expert_name(name) is not None:
                yield from fuser.add(name, tensor.contiguous())  # the fused tensor, once complete
            elif keep is None or keep(name):
                yield name, tensor.contiguous()
