"""Models: loading HF checkpoints, tiny local models and tokenizer, and padding-free attention.

Importing this package registers the ``"verl_varlen"`` and ``"verl_ulysses"`` attention implementations
with transformers.
"""

from verl_trainer.models.attention import (
    VARLEN_ATTENTION,
    block_diagonal_causal_mask,
    cu_seqlens_from_position_ids,
    ensure_varlen_attention,
    packed_forward,
    reference_packed_forward,
    register_varlen_attention,
    varlen_attention,
    varlen_attention_forward,
    varlen_model_kwargs,
)
from verl_trainer.models.loading import load_causal_lm, load_tokenizer, load_value_model
from verl_trainer.models.tiny import build_tokenizer, make_tiny_model
from verl_trainer.models.ulysses_attention import ULYSSES_ATTENTION, check_ulysses_compatible

__all__ = [
    "ULYSSES_ATTENTION",
    "check_ulysses_compatible",
    "VARLEN_ATTENTION",
    "block_diagonal_causal_mask",
    "build_tokenizer",
    "cu_seqlens_from_position_ids",
    "ensure_varlen_attention",
    "load_causal_lm",
    "load_tokenizer",
    "load_value_model",
    "make_tiny_model",
    "packed_forward",
    "reference_packed_forward",
    "register_varlen_attention",
    "varlen_attention",
    "varlen_attention_forward",
    "varlen_model_kwargs",
]
