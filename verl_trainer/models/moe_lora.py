"""LoRA on a mixture-of-experts model: which names to target, and what this project refuses.

peft (0.17+) adapts a transformers 5.x MoE block's fused expert tensors (``experts.gate_up_proj`` /
``experts.down_proj``, ``[E, out, in]`` parameters, no ``nn.Linear``) through a ``ParamWrapper``
(``LoraConfig.target_parameters`` = ``EngineConfig.target_parameters``; ``target_modules="all-linear"``
selects them and the router's weight too). Their merge and per-tensor export live in
``engine/lora_params.py``. :func:`refuse_expert_lora` refuses the ``ParamWrapper`` cases that cannot work.
"""

from __future__ import annotations

from torch import nn

ATTENTION_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
"""The ``target_modules`` to name for LoRA on a MoE model's attention."""

EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
"""The ``target_parameters`` naming transformers 5's fused experts (qwen3_moe, mixtral, qwen2_moe)."""


def refuse_expert_lora(name: str, module: nn.Module) -> None:
    """Refuse a peft ``ParamWrapper`` (LoRA on a parameter) that the merge and export cannot serve.

    Raises:
        ValueError: Names the layer and the fix.
    """
    ndim = module.get_param().dim()  # before sharding: the full parameter
    if ndim not in (2, 3):
        raise ValueError(
            f"LoRA on {name}.{module.parameter_name}: a {ndim}-D parameter; only 2-D and 3-D (fused experts "
            f"[E, out, in]) parameters are merged here; set actor.engine.target_parameters={EXPERT_TARGETS}")


PARAM_LORA_BACKENDS = ("fsdp2",)
"""Backends whose sharding serves peft's ``ParamWrapper`` (a parametrization registered per forward)."""

_WHY_NOT = {
    "fsdp": "FSDP1's flat parameters are views that peft's per-forward parametrization cannot replace "
            "(autograd: 'a view ... has been modified inplace')",
    "deepspeed": "DeepSpeed's partitioned parameters are not known to work with peft's per-forward "
                 "parametrization (not verified: a 2-rank ZeRO-2/3 step did not finish)",
}


def refuse_param_lora_backend(backend: str, what: str | None) -> None:
    """Refuse LoRA on parameters (``what``: the adapted names; ``None``: none) on a backend not serving it.

    Raises:
        ValueError: Names the backend, why, and the fix (strategy fsdp2, or attention-only targets).
    """
    if what is None or backend in PARAM_LORA_BACKENDS:
        return
    why = _WHY_NOT.get("deepspeed" if backend.startswith("deepspeed") else backend,
                       "it is not verified with peft's ParamWrapper")
    raise ValueError(
        f"LoRA on parameters ({what}: a MoE model's fused experts / router) is not supported on the "
        f"{backend!r} backend: {why}; use strategy='fsdp2', or set actor.engine.target_parameters=null and "
        f"target_modules={ATTENTION_TARGETS} (LoRA on attention; 'all-linear' selects the experts too)")


def param_lora_names(model: nn.Module) -> str | None:
    """The ``module.parameter`` names peft adapts through a ``ParamWrapper`` in ``model`` (``None``: none)."""
    names = sorted({f"{name.replace('.base_layer', '').split('.')[-1]}.{module.parameter_name}"
                    for name, module in model.named_modules() if type(module).__name__ == "ParamWrapper"})
    return ", ".join(names) if names else None
