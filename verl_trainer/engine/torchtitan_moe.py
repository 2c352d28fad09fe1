"""Qwen3-MoE through torchtitan: its ``MoE`` layer (router, token dispatcher, grouped experts) and EP.

:func:`moe_layer_config` builds torchtitan's ``MoE.Config`` for one layer of an HF ``qwen3_moe`` config:
torchtitan's ``TokenChoiceTopKRouter`` (softmax scores in fp32, top-k, ``route_norm`` =
``norm_topk_prob``), its all-to-all token dispatcher (``comm_backend="standard"``: local reordering at
``ep=1``, ``all_to_all_single`` over the EP mesh at ``ep > 1``) and its grouped experts. What the HF model
does is matched exactly, so the routing is the same:

* torchtitan's auxiliary-loss-free load balancing (the ``expert_bias_E`` buffer, moved by an optimizer
  hook) is off (``load_balance_coeff=None``): the HF model has no such bias;
* no token dropping: the standard dispatcher has no capacity factor, neither has HF's Qwen3-MoE;
* no auxiliary loss: neither model adds one to the forward here (a router loss is the engine's, see
  ``docs/torchtitan.md``).

Experts on CPU: torchtitan's ``GroupedExperts`` always casts to bf16 for ``torch._grouped_mm``, whose CPU
backward fails; :class:`LoopedExperts` (a ``GroupedExperts`` with the same parameters, so the same
sharding and state-dict names) runs each local expert's SwiGLU as plain matmuls in the weights' dtype.
On CUDA torchtitan's own grouped GEMM runs (bf16 expert matmuls).

HF weights: transformers 5 keeps a layer's experts fused (``mlp.experts.gate_up_proj [E, 2F, D]``,
``mlp.experts.down_proj [E, D, F]``); the checkpoints on the hub and torchtitan's ``Qwen3StateDictAdapter``
use one tensor per expert (``mlp.experts.{e}.gate_proj.weight``...). :func:`split_fused_experts` turns the
former into the latter before the adapter; :class:`FusedExpertNames` names torchtitan's grouped weights
back as transformers 5's fused tensors for the weight stream and ``save_hf``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.models.common.config_utils import make_moe_config, make_router_config
from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

MOE_MODEL_TYPES = ("qwen3_moe",)
"""HF ``model_type`` values whose MoE layers the torchtitan backend builds (torchtitan's Qwen3 MoE)."""

_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_GROUPED = re.compile(r"^layers\.(\d+)\.moe\.routed_experts\.inner_experts\.(w1_EFD|w2_EDF|w3_EFD)$")


class LoopedExperts(GroupedExperts):
    """torchtitan's grouped experts computed one local expert at a time, in the weights' dtype.

    ``forward(x_RD [R, D], num_tokens_per_expert_E [e]) -> [R, D]``: rows of ``x_RD`` are grouped by
    expert (``num_tokens_per_expert_E[i]`` rows for local expert ``i``, in order); each group gets
    ``w2 (silu(w1 x) * w3 x)`` (SwiGLU, the HF expert's formula). The parameters are the parent's
    (``w1_EFD [E, F, D]``, ``w2_EDF [E, D, F]``, ``w3_EFD [E, F, D]``; ``E`` local under EP).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        """``GroupedExperts.Config``; a class of its own because ``build()`` constructs the owner class."""

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:  # noqa: N803
        """``[R, D]`` expert outputs of the expert-grouped rows ``x_RD`` (see the class docstring)."""
        weights = [w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF,
                                                                          self.w3_EFD)]
        w1, w2, w3 = (w.to(x_RD.dtype) for w in weights)
        counts = [int(c) for c in num_tokens_per_expert_E.tolist()]
        outputs = []
        for expert, rows in enumerate(x_RD.split(counts, dim=0)):
            hidden = F.silu(rows @ w1[expert].t()) * (rows @ w3[expert].t())
            outputs.append(hidden @ w2[expert].t())
        if not outputs:
            return x_RD.new_zeros(x_RD.shape)
        out = torch.cat(outputs, dim=0)
        # an expert with no rows still joins the graph (its weights' gradients are zeros, not None)
        return out + 0.0 * sum(w.sum() for w in (w1, w2, w3))


def check_moe_config(hf_config: Any) -> None:
    """Refuse a Qwen3-MoE config torchtitan's MoE layer does not represent exactly.

    Raises:
        ValueError: For ``decoder_sparse_step != 1`` (dense layers between MoE layers by a stride),
            naming the value and the fix.
    """
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    if step != 1:
        raise ValueError(
            f"qwen3_moe config has decoder_sparse_step={step}; the torchtitan backend builds MoE layers "
            f"with decoder_sparse_step=1 (every layer not in mlp_only_layers); use strategy='fsdp2' for "
            f"this checkpoint"
        )


def is_moe_layer(hf_config: Any, layer: int) -> bool:
    """Whether decoder layer ``layer`` of a Qwen3-MoE config is a MoE layer (not in ``mlp_only_layers``)."""
    return layer not in set(getattr(hf_config, "mlp_only_layers", None) or [])


def num_experts(hf_config: Any) -> int:
    """Routed experts per MoE layer (``num_experts``; transformers 5 also calls it ``num_local_experts``)."""
    return int(getattr(hf_config, "num_experts", None) or hf_config.num_local_experts)


def moe_layer_config(hf_config: Any, device_type: str, zero_init: dict[str, Any]) -> MoE.Config:
    """Torchtitan's ``MoE.Config`` matching one MoE layer of ``hf_config`` (see the module docstring)."""
    dim, experts = int(hf_config.hidden_size), num_experts(hf_config)
    top_k = int(hf_config.num_experts_per_tok)
    hidden = int(hf_config.moe_intermediate_size)
    experts_cls = LoopedExperts if device_type == "cpu" else GroupedExperts
    return make_moe_config(
        num_experts=experts,
        router=make_router_config(dim=dim, num_experts=experts, gate_param_init=zero_init, top_k=top_k,
                                  score_func="softmax", route_norm=bool(hf_config.norm_topk_prob)),
        routed_experts=RoutedExperts.Config(
            inner_experts=experts_cls.Config(dim=dim, hidden_dim=hidden, num_experts=experts,
                                             param_init={name: torch.nn.init.zeros_ for name in
                                                         ("w1_EFD", "w2_EDF", "w3_EFD")}),
            token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=experts, top_k=top_k),
        ),
        load_balance_coeff=None,  # no expert-bias balancing: the HF model routes without one
    )


def split_fused_experts(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Transformers 5's fused expert tensors as one tensor per expert (the adapter's HF names).

    ``model.layers.{l}.mlp.experts.gate_up_proj [E, 2F, D]`` -> ``...experts.{e}.gate_proj.weight [F, D]``
    (rows ``:F``) and ``...experts.{e}.up_proj.weight`` (rows ``F:``); ``down_proj [E, D, F]`` ->
    ``...experts.{e}.down_proj.weight [D, F]``. Other entries are kept; a per-expert checkpoint passes
    as is.
    """
    out: dict[str, torch.Tensor] = {}
    for name, value in state_dict.items():
        match = _FUSED.match(name)
        if match is None:
            out[name] = value
            continue
        prefix = f"model.layers.{match.group(1)}.mlp.experts"
        if match.group(2) == "gate_up_proj":
            gate, up = value.chunk(2, dim=1)
            for e in range(value.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = gate[e]
                out[f"{prefix}.{e}.up_proj.weight"] = up[e]
        else:
            for e in range(value.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = value[e]
    return out


class FusedExpertNames:
    """torchtitan's grouped expert weights as transformers 5's fused HF tensors, one layer at a time.

    ``w2_EDF`` is ``mlp.experts.down_proj`` as is; ``w1_EFD`` and ``w3_EFD`` together are
    ``mlp.experts.gate_up_proj = cat([w1, w3], dim=1)``: :meth:`add` holds the first half until the
    second arrives.
    """

    def __init__(self) -> None:
        self._halves: dict[str, dict[str, torch.Tensor]] = {}

    @staticmethod
    def hf_name(name: str) -> str | None:
        """The fused HF name of a grouped expert parameter name, else ``None``."""
        match = _GROUPED.match(name)
        if match is None:
            return None
        layer, part = match.groups()
        fused = "down_proj" if part == "w2_EDF" else "gate_up_proj"
        return f"model.layers.{layer}.mlp.experts.{fused}"

    def add(self, name: str, full: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` once ``name``'s fused HF tensor is complete (``full`` is unsharded)."""
        hf_name = self.hf_name(name)
        assert hf_name is not None, name
        if name.endswith("w2_EDF"):
            yield hf_name, full
            return
        halves = self._halves.setdefault(hf_name, {})
        halves[name.rsplit(".", 1)[1]] = full
        if len(halves) == 2:
            del self._halves[hf_name]
            yield hf_name, torch.cat([halves["w1_EFD"], halves["w3_EFD"]], dim=1)


def check_expert_parallel(hf_config: Any, config: Any, world_size: int | None) -> None:
    """Refuse an ``expert_model_parallel_size`` torchtitan's EP cannot apply to this model / layout.

    EP shards each MoE layer's experts over ``ep`` ranks of the data-parallel group (torchtitan's ``ep``
    mesh; the rest of the model stays FSDP over dp), so ``ep`` must divide the expert count and the
    data-parallel size. ``world_size=None`` (before the process group) skips the latter.

    Raises:
        ValueError: ``ep > 1`` with a dense model, with TP, or with sizes that do not divide; the message
            names the value and the valid choices.
    """
    ep = int(config.expert_model_parallel_size)
    if ep == 1:
        return
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in MOE_MODEL_TYPES:
        raise ValueError(
            f"expert_model_parallel_size={ep} needs a mixture-of-experts model; strategy='torchtitan' "
            f"applies EP to HF model_type in {MOE_MODEL_TYPES}, got {model_type!r}: set "
            f"expert_model_parallel_size=1"
        )
    if config.tensor_model_parallel_size > 1:
        raise ValueError(
            f"expert_model_parallel_size={ep} with tensor_model_parallel_size="
            f"{config.tensor_model_parallel_size} is not supported by strategy='torchtitan' (expert TP is "
            f"not wired); set one of them to 1"
        )
    experts = num_experts(hf_config)
    if experts % ep:
        valid = [d for d in range(1, experts + 1) if experts % d == 0]
        raise ValueError(f"expert_model_parallel_size={ep} does not divide the model's {experts} experts; "
                         f"choose one of {valid}")
    if world_size is not None and world_size % ep:
        raise ValueError(f"expert_model_parallel_size={ep} does not divide the {world_size} data-parallel "
                         f"ranks (EP runs inside dp); choose a divisor of {world_size}")
