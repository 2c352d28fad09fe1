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
    ndim = getattr(module, "_param_ndim", 0)
    if ndim not in (2, 3):
        raise ValueError(
            f"LoRA on {name}.{module.parameter_name}: a {ndim}-D parameter; only 2-D and 3-D (fused experts "
            f"[E, out, in]) parameters are merged here; set actor.engine.target_parameters={EXPERT_TARGETS}")
