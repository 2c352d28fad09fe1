"""A tiny policy behind the token server, with a tokenizer whose decode-encode round trip differs."""

from __future__ import annotations

from pathlib import Path

from tokenizers import normalizers

from verl_trainer.models.tiny import build_tokenizer, make_tiny_model
from verl_trainer.rollout.config import RolloutConfig
from verl_trainer.rollout.hf import HFRollout


def lossy_tokenizer():
    """The character tokenizer that lower-cases on encode: ``encode(decode([id('A')])) == [id('a')]``."""
    tokenizer = build_tokenizer()
    tokenizer.backend_tokenizer.normalizer = normalizers.Lowercase()
    return tokenizer


def tiny_rollout(path: Path, max_new_tokens: int = 12, **overrides) -> HFRollout:
    """An HF rollout of a 1-layer qwen2 at ``path`` (built once) with :func:`lossy_tokenizer`."""
    if not (path / "config.json").exists():
        make_tiny_model(path, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1)
    config = RolloutConfig(max_new_tokens=max_new_tokens, device="cpu", **overrides)
    return HFRollout(config, str(path), lossy_tokenizer())


def round_trip_differs(tokenizer, ids: list[int]) -> bool:
    """Whether re-encoding the decoded ``ids`` gives other ids."""
    return list(tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)) != list(ids)
