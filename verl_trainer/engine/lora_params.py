"""LoRA on parameters (peft ``target_parameters``): a MoE block's fused expert tensors, merged per tensor.

peft adapts an ``nn.Parameter`` that no ``nn.Linear`` holds — transformers 5's fused experts
(``mlp.experts.gate_up_proj`` ``[E, 2·I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``) or a router's
``weight`` — through a ``ParamWrapper``. Several parameters of one module nest: the outer wrapper's
``base_layer`` is the next wrapper, so the state dict holds ``experts.lora_A.<a>.weight`` (outer),
``experts.base_layer.lora_A.<a>.weight`` (inner) and ``experts.base_layer.base_layer.gate_up_proj`` (the
parameter). For each wrapper with ``E`` experts, rank ``r``, and ``in`` / ``out`` the per-expert features:

* ``lora_A.weight`` is ``[E·r, in]``, viewed as ``a[e] = A[e·r:(e+1)·r]`` (``[r, in]``);
* ``lora_B.weight`` is ``[out, r·E]``, viewed as ``b[e] = B.reshape(out, r, E)[:, :, e]`` (``[out, r]``);
* the delta of expert ``e`` is ``scale · b[e] @ a[e]`` (``[out, in]``), stored transposed (``[in, out]``)
  where the parameter is laid out ``[E, in, out]`` (peft's ``_did_swap_in_out_features`` is False).

A 2-D parameter (``E = 1``, a router's ``weight [E_routed, H]``) gets ``scale · B @ A``. This is peft's
``ParamWrapper.get_delta_weight`` (peft/tuners/lora/layer.py), recomputed here from the gathered full
tensors so the engine's sharded weights are never merged in place.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

_BASE_LAYER = re.compile(r"\.base_layer(?=\.)")


def is_param_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is peft's ``ParamWrapper`` (LoRA on a parameter, ``target_parameters``)."""
    from peft.tuners.lora.layer import ParamWrapper

    return isinstance(module, ParamWrapper)


@dataclass(frozen=True)
class ParamTarget:
    """One adapted parameter: the state-dict names of its tensors and how its delta is formed.

    Attributes:
        param: The adapted parameter's name (``...experts.base_layer.base_layer.gate_up_proj``).
        lora_a: Its ``lora_A`` weight's name.
        lora_b: Its ``lora_B`` weight's name.
        scale: ``lora_alpha / r`` (or the rsLoRA scale) of the adapter.
        num_experts: ``E`` (1 for a 2-D parameter).
        in_out: The parameter is laid out ``[E, in, out]`` (the delta is transposed per expert).
    """

    param: str
    lora_a: str
    lora_b: str
    scale: float
    num_experts: int
    in_out: bool

    def delta(self, lora_a: torch.Tensor, lora_b: torch.Tensor, ndim: int) -> torch.Tensor:
        """``scale · B·A`` in float32 in the parameter's layout (see the module).

        Args:
            lora_a: ``[E·r, in]``.
            lora_b: ``[out, r·E]``.
            ndim: The parameter's number of dimensions (2 or 3).

        Returns:
            ``[out, in]`` for a 2-D parameter, ``[E, out, in]`` (``[E, in, out]`` when ``in_out``) for 3-D.
        """
        a, b = lora_a.float(), lora_b.float()
        if ndim == 2:
            return self.scale * (b @ a)
        experts = self.num_experts
        a = a.reshape(experts, -1, a.shape[-1])  # [E, r, in]
        b = b.reshape(b.shape[0], -1, experts).permute(2, 0, 1)  # [E, out, r]
        delta = torch.bmm(b, a)  # [E, out, in]
        if self.in_out:
            delta = delta.transpose(1, 2)
        return self.scale * delta

    def merge(self, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
        """``W + delta`` in float32, returned in ``W``'s dtype (a new tensor; ``W`` is not modified)."""
        return (weight.float() + self.delta(lora_a, lora_b, weight.dim())).to(weight.dtype)


def param_targets(peft_model: nn.Module, adapter: str,
                  clean: Callable[[str], str] = str) -> dict[str, ParamTarget]:
    """The adapted parameters of ``peft_model`` for ``adapter``, keyed by the wrapper's module name.

    Args:
        peft_model: The ``PeftModel`` (possibly inside FSDP1 / checkpoint wrappers).
        adapter: The adapter's name.
        clean: Removes wrapper parts from a name (``lora_export.clean_name``).
    """
    out = {}
    for name, module in peft_model.named_modules():
        if not is_param_wrapper(module) or adapter not in module.lora_A:
            continue
        name = clean(name)
        inner, path = module.base_layer, f"{name}.base_layer"
        while is_param_wrapper(inner):
            inner, path = inner.base_layer, f"{path}.base_layer"
        out[name] = ParamTarget(
            param=clean(f"{path}.{module.parameter_name}"),
            lora_a=f"{name}.lora_A.{adapter}.weight",
            lora_b=f"{name}.lora_B.{adapter}.weight",
            scale=float(module.scaling[adapter]),
            num_experts=int(module.num_experts),
            in_out=not module._did_swap_in_out_features,
        )
    return out


def without_base_layers(name: str) -> str:
    """``name`` without peft's ``.base_layer`` parts (nested wrappers have several)."""
    return _BASE_LAYER.sub("", name)


class ParamMerger:
    """Collects each adapted parameter's three tensors from a state-dict stream and merges them.

    Args:
        targets: :func:`param_targets` of the model.
    """

    def __init__(self, targets: dict[str, ParamTarget]) -> None:
        self.roles: dict[str, tuple[str, str]] = {}
        for key, target in targets.items():
            for name, role in ((target.param, "W"), (target.lora_a, "A"), (target.lora_b, "B")):
                self.roles[name] = (key, role)
        self.targets = targets
        self.wrappers = set(targets)
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def owns(self, name: str) -> bool:
        """Whether ``name`` belongs to an adapted parameter (its weight, or any adapter's ``A`` / ``B``)."""
        if name in self.roles:
            return True
        for part in (".lora_A.", ".lora_B."):
            if part in name and name.split(part)[0] in self.wrappers:
                return True  # another adapter's A / B: dropped
        return False

    def add(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """Take one owned tensor; returns ``(param name, merged tensor)`` once its three tensors are in."""
        if name not in self.roles:
            return None
        key, role = self.roles[name]
        parts = self.pending.setdefault(key, {})
        parts[role] = tensor
        if len(parts) < 3:
            return None
        del self.pending[key]
        target = self.targets[key]
        return target.param, target.merge(parts["W"], parts["A"], parts["B"])

    def incomplete(self) -> dict[str, list[str]]:
        """The adapted parameters whose weight, ``A`` or ``B`` never arrived."""
        return {self.targets[key].param: sorted(parts) for key, parts in self.pending.items()}
