"""LoRA on a mixture-of-experts model: what peft adapts there, and what this project refuses.

peft (0.17+) adapts a transformers 5.x MoE block's fused expert tensors (``experts.gate_up_proj`` /
``experts.down_proj``, ``[E, out, in]`` parameters, no ``nn.Linear``) and its router's weight through a
``ParamWrapper`` (``target_parameters``); ``target_modules="all-linear"`` selects them too. The adapter
merge and the per-tensor export here handle LoRA on ``nn.Linear`` only, so a ``ParamWrapper`` is refused
with the fix: adapt the attention projections (and a shared expert's linear layers), which trains with
every router feature (docs/moe.md).
"""

from __future__ import annotations

from torch import nn

ATTENTION_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
"""The ``target_modules`` to name for LoRA on a MoE model's attention."""


def refuse_expert_lora(name: str, module: nn.Module) -> None:
    """Refuse a peft ``ParamWrapper`` (LoRA on fused expert or router parameters).

    Raises:
        ValueError: ``module`` is a ``ParamWrapper``; names the layer and the fix.
    """
    if type(module).__name__ == "ParamWrapper":
        raise ValueError(
            f"LoRA on {name}: peft adapts a mixture-of-experts model's fused expert / router parameters "
            "through a ParamWrapper, whose merge and export are not supported here yet (only LoRA on "
            f"nn.Linear layers); set actor.engine.target_modules={ATTENTION_TARGETS} (attention; add a "
            "shared expert's gate_proj / up_proj / down_proj where the model has one), not 'all-linear'")
