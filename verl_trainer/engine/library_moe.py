"""MoE options of the HF engines that the library backends (torchtitan, megatron) do not serve, refused.

The router replay, router losses and router metrics (``EngineConfig.moe``: ``models/moe_config.py``) hook
transformers' router modules; torchtitan's ``TokenChoiceTopKRouter`` and Megatron's ``TopKRouter`` are
other modules, so a request for replay or a router loss is refused by name at construction (before any
model loads), instead of training without it. Router metrics are not logged by these backends.
"""

from __future__ import annotations

from typing import Any

__all__ = ["UNSERVED_MOE_OPTIONS", "check_moe_options"]

UNSERVED_MOE_OPTIONS = ("router_replay", "aux_loss_coeff", "z_loss_coeff")
"""``EngineConfig.moe`` fields refused at a non-default value by the library backends."""

_DEFAULTS = {"router_replay": "off", "aux_loss_coeff": 0.0, "z_loss_coeff": 0.0}


def check_moe_options(config: Any, strategy: str) -> None:
    """Raise ``ValueError`` if ``config.moe`` asks for what ``strategy`` does not serve (see above).

    ``config`` without a ``moe`` section passes (nothing asked).

    Raises:
        ValueError: Naming the option, its value, why, and the fix (its default, or an HF engine).
    """
    moe = getattr(config, "moe", None)
    if moe is None:
        return
    for name in UNSERVED_MOE_OPTIONS:
        value = getattr(moe, name, _DEFAULTS[name])
        if value != _DEFAULTS[name]:
            raise ValueError(
                f"moe.{name}={value!r} is not served by strategy={strategy!r}: the router replay, router "
                f"losses and router metrics hook transformers' router modules, and this backend runs "
                f"{'torchtitan' if strategy == 'torchtitan' else 'Megatron-Core'}'s own router; set "
                f"moe.{name}={_DEFAULTS[name]!r}, or use strategy='fsdp2' (or 'fsdp', 'deepspeed')"
            )
