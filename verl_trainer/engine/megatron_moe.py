"""Mixture-of-experts ``GPTModel`` for the Megatron engine: HF Qwen3-MoE as Megatron's ``MoELayer``.

Megatron's MoE layer (``TopKRouter``, a token dispatcher, ``SequentialMLP`` experts on the local spec) is
configured through mbridge's Qwen3-MoE bridge, with the settings that make the routing the HF model's
(:func:`moe_config_overrides`):

* ``moe_router_pre_softmax = not norm_topk_prob``: Megatron's softmax router either takes the top-k of the
  logits and softmaxes over those k (the renormalised top-k probabilities, HF's ``norm_topk_prob=True``),
  or softmaxes over all experts first (HF's ``norm_topk_prob=False``);
* no load balancing, no auxiliary loss, no expert bias (``moe_router_load_balancing_type="none"``,
  ``moe_aux_loss_coeff=0``), no capacity factor (no token dropping): the HF forward has none of them;
* the router in fp32 (``moe_router_dtype="fp32"``), as HF's softmax;
* the all-gather token dispatcher on CPU (``moe_token_dispatcher_type="allgather"``: the all-to-all one
  creates a ``torch.cuda.Stream`` when built), the all-to-all one on CUDA;
* experts as ``SequentialMLP`` (one plain MLP per local expert): ``moe_grouped_gemm`` needs the
  ``grouped_gemm`` CUDA package or Transformer Engine.

Expert parallelism (``expert_model_parallel_size > 1``, :func:`check_expert_parallel`): Megatron's EP group
of ``ep`` adjacent dp ranks (``megatron_model.megatron_groups``); on CPU the all-gather dispatcher gathers
the tokens over it and reduce-scatters the expert outputs back (gloo has both collectives), on CUDA the
all-to-all dispatcher exchanges them. Megatron's DDP reduces the expert gradients over the expert-data-
parallel group scaled by ``1 / dp`` (a mean over dp, as the rest); the grad norm sums the experts' squares
over the EP group (``megatron_grads.py``); the HF export all-gathers each expert weight over the EP group
(``megatron_bridge.hf_tensors``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["MOE_ARCHITECTURES", "ExpertFuser", "check_expert_parallel", "fused_expert_name", "is_moe",
           "moe_config_overrides"]

MOE_ARCHITECTURES = ("qwen3_moe",)
"""HF ``model_type`` values of mixture-of-experts models the Megatron engine builds."""


def is_moe(hf_config: Any) -> bool:
    """Whether ``hf_config`` is a mixture-of-experts model the engine builds."""
    return getattr(hf_config, "model_type", None) in MOE_ARCHITECTURES


def moe_config_overrides(hf_config: Any, device_type: str, ep: int = 1) -> dict[str, Any]:
    """``TransformerConfig`` settings of the MoE layers (the module docstring); ``{}`` for a dense model."""
    if not is_moe(hf_config):
        return {}
    return {
        "expert_model_parallel_size": ep,
        "moe_router_pre_softmax": not bool(getattr(hf_config, "norm_topk_prob", False)),
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_z_loss_coeff": None,
        "moe_router_enable_expert_bias": False,
        "moe_expert_capacity_factor": None,
        "moe_router_dtype": "fp32",
        "moe_grouped_gemm": False,
        "moe_token_dispatcher_type": "allgather" if device_type == "cpu" else "alltoall",
        # mbridge sets it for pipeline p2p shapes; the engine has no PP, and the allgather dispatcher
        # refuses it
        "variable_seq_lengths": False,
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
    }


def check_expert_parallel(config: Any, hf_config: Any | None, world_size: int | None) -> None:
    """Refuse an ``expert_model_parallel_size`` the Megatron engine cannot apply to this model / layout.

    EP splits each MoE layer's experts over ``ep`` adjacent data-parallel ranks (Megatron's ``ep`` group;
    the ranks holding the same experts form its expert-data-parallel group). ``hf_config=None`` /
    ``world_size=None`` skip the checks that need them.

    Raises:
        ValueError: ``ep > 1`` with a dense model, with TP, or with sizes that do not divide; the message
            names the value and the valid choices.
    """
    ep = int(config.expert_model_parallel_size)
    if ep == 1:
        return
    if hf_config is not None and not is_moe(hf_config):
        raise ValueError(
            f"expert_model_parallel_size={ep} needs a mixture-of-experts model; the megatron engine builds "
            f"MoE for HF model_type in {MOE_ARCHITECTURES}, got {getattr(hf_config, 'model_type', None)!r}: "
            f"set expert_model_parallel_size=1"
        )
    if config.tensor_model_parallel_size > 1:
        raise ValueError(
            f"expert_model_parallel_size={ep} with tensor_model_parallel_size="
            f"{config.tensor_model_parallel_size} is not supported by the megatron engine (expert TP and the "
            f"tp x ep group layout are not wired); set one of them to 1"
        )
    if hf_config is not None:
        experts = int(hf_config.num_experts)
        if experts % ep:
            valid = [d for d in range(1, experts + 1) if experts % d == 0]
            raise ValueError(f"expert_model_parallel_size={ep} does not divide the model's {experts} "
                             f"experts; choose one of {valid}")
    if world_size is not None and world_size % ep:
        raise ValueError(f"expert_model_parallel_size={ep} does not divide the {world_size} data-parallel "
                         f"ranks (EP runs inside dp); choose a divisor of {world_size}")


_PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)"
                         r"\.weight$")


def fused_expert_name(hf_name: str) -> str | None:
    """Transformers 5's fused name of a per-expert HF name, else ``None``.

    ``...experts.{e}.gate_proj.weight`` / ``up_proj`` -> ``...experts.gate_up_proj``; ``down_proj`` ->
    ``...experts.down_proj``.
    """
    match = _PER_EXPERT.match(hf_name)
    if match is None:
        return None
    fused = "down_proj" if match.group(3) == "down_proj" else "gate_up_proj"
    return f"model.layers.{match.group(1)}.mlp.experts.{fused}"


class ExpertFuser:
    """Per-expert HF tensors (mbridge's export) in, transformers 5's fused expert tensors out.

    ``gate_up_proj [E, 2F, D]`` stacks ``cat([gate_e, up_e])`` over the experts, ``down_proj [E, D, F]``
    stacks ``down_e``; :meth:`add` yields a fused tensor once all ``num_experts`` experts' parts are in.
    """

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self._parts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}

    def add(self, hf_name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(fused_name, tensor)`` when ``hf_name`` completes its fused tensor; else nothing."""
        match = _PER_EXPERT.match(hf_name)
        assert match is not None, hf_name
        fused = fused_expert_name(hf_name)
        assert fused is not None
        parts = self._parts.setdefault(fused, {})
        parts[(int(match.group(2)), match.group(3))] = tensor
        kinds = ("down_proj",) if fused.endswith("down_proj") else ("gate_proj", "up_proj")
        if len(parts) < self.num_experts * len(kinds):
            return
        del self._parts[fused]
        yield fused, torch.stack([torch.cat([parts[(e, k)] for k in kinds], dim=0)
                                  for e in range(self.num_experts)])
