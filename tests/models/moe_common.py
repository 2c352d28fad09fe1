"""Shared pieces of the MoE tests: the tiny Qwen3-MoE."""

from __future__ import annotations

from verl_trainer.models.tiny import make_tiny_model


def tiny_moe(path: str, arch: str = "qwen3_moe") -> str:
    """A 2-layer tiny MoE (4 experts, top-2, hidden 32)."""
    return make_tiny_model(path, arch=arch, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, seed=1)
