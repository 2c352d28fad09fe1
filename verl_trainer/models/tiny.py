"""Tiny models and a character-level tokenizer, built locally (no model hub), for tests and CPU recipes.

``make_tiny_model(path)`` writes a randomly initialised HF causal LM (Qwen2, Llama or Qwen3) and the project's
character tokenizer with ``save_pretrained``; :mod:`verl_trainer.models.loading` reads them back through
the real ``from_pretrained`` path, exactly as for a hub checkpoint on disk.

The tokenizer maps every character of :data:`CHARS` to one id (after the special tokens ``<pad>``,
``<bos>``, ``<eos>``, ``<unk>``), so arithmetic prompts like ``"12+7="`` tokenise to one id per character
and decode back to the same text.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedTokenizerFast,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
CHARS = string.digits + string.ascii_letters + "+-*/=()<>.,:;?!%^'\"_#[]{}|&~@$\\ \n"
"""The characters of the vocabulary, one token each (ids after the special tokens)."""

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
"""A minimal chat template (``role: content`` lines) so ``apply_chat_template`` works."""

DENSE_ARCHITECTURES = ("qwen2", "llama", "qwen3")
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3")
"""Mixture-of-experts architectures: 4 routed experts, top-2, unless overridden (``qwen2_moe`` and
``deepseek_v3`` add shared experts; ``deepseek_v3`` uses multi-head latent attention)."""
ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES


def _byte_level_char(ch: str) -> str:
    """Map an ASCII character to its byte-level BPE stand-in (space -> "Ġ", newline -> "Ċ")."""
    b = ord(ch)
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    if b in printable:
        return ch
    return chr(256 + sorted(set(range(256)) - set(printable)).index(b))


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Build the project's character-level tokenizer (a ``PreTrainedTokenizerFast``).

    It is a byte-level BPE without merges over the characters of :data:`CHARS`, so every character
    is one token whatever pre-tokenizer runs first. That matters because ``AutoTokenizer`` rebuilds
    the tokenizer of a ``qwen2`` checkpoint as ``Qwen2Tokenizer`` from the saved vocab and merges (with
    its own regex pre-tokenizer): with no merges it still splits into the same characters, and the
    byte-level stand-ins keep spaces and newlines.

    Returns:
        A tokenizer with ``pad_token_id=0``, ``bos_token_id=1``, ``eos_token_id=2``, ``unk_token_id=3``;
        it adds no special tokens on encode and right-pads.

    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({_byte_level_char(ch): len(SPECIAL_TOKENS) + i for i, ch in enumerate(CHARS)})
    tok = Tokenizer(models.BPE(vocab, merges=[], unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _model_config(arch: str, tokenizer: PreTrainedTokenizerFast, **overrides: Any) -> PretrainedConfig:
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny-model arch {arch!r}; choose one of {ARCHITECTURES}")
    if arch in ("qwen3", "qwen3_moe"):  # Qwen3's head_dim defaults to 128, not hidden // heads
        overrides.setdefault("head_dim", overrides["hidden_size"] // overrides["num_attention_heads"])
    if arch in MOE_ARCHITECTURES:
        _moe_defaults(arch, overrides)
    return AutoConfig.for_model(
        arch,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        **overrides,
    )


def _moe_defaults(arch: str, overrides: dict[str, Any]) -> None:
    """Fill a tiny MoE's expert fields (4 experts, top-2, expert width = the MLP width) where not given."""
    hidden, width = overrides["hidden_size"], overrides["intermediate_size"]
    overrides.setdefault("num_experts_per_tok", 2)
    if arch == "mixtral":
        overrides.setdefault("num_local_experts", 4)
        return
    overrides.setdefault("moe_intermediate_size", width)
    if arch == "qwen3_moe":
        overrides.setdefault("num_experts", 4)
    elif arch == "qwen2_moe":
        overrides.setdefault("num_experts", 4)
        overrides.setdefault("shared_expert_intermediate_size", width)
    else:  # deepseek_v3: MLA with small ranks, one shared expert, every layer sparse
        heads = overrides["num_attention_heads"]
        overrides.setdefault("n_routed_experts", 4)
        overrides.setdefault("n_shared_experts", 1)
        overrides.setdefault("n_group", 1)
        overrides.setdefault("topk_group", 1)
        overrides.setdefault("first_k_dense_replace", 0)
        overrides.setdefault("kv_lora_rank", hidden // 2)
        overrides.setdefault("q_lora_rank", hidden)
        overrides.setdefault("qk_rope_head_dim", hidden // heads // 2)
        overrides.setdefault("qk_nope_head_dim", hidden // heads // 2)
        overrides.setdefault("v_head_dim", hidden // heads)
        overrides.setdefault("head_dim", hidden // heads // 2)


def make_tiny_model(
    path: str | Path,
    arch: str = "qwen2",
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    **config_overrides: Any,
) -> str:
    """Write a randomly initialised tiny causal LM and the character tokenizer to ``path``.

    Args:
        path: Output directory (created).
        arch: One of :data:`ARCHITECTURES` (dense or mixture-of-experts).
        hidden_size: Model width.
        num_hidden_layers: Number of decoder layers.
        num_attention_heads: Query heads.
        num_key_value_heads: Key/value heads (GQA when fewer than the query heads).
        intermediate_size: MLP width; default ``2 * hidden_size``.
        max_position_embeddings: Longest sequence the rotary embedding is configured for.
        seed: Seed of the weight initialisation (the global RNG state is left untouched).
        **config_overrides: Any other config field (e.g. ``rope_theta``, ``initializer_range``).

    Returns:
        ``str(path)``, ready for ``from_pretrained``.

    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = _model_config(
        arch,
        tokenizer,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size or 2 * hidden_size,
        max_position_embeddings=max_position_embeddings,
        **config_overrides,
    )
    save_initialised(path, AutoModelForCausalLM, config, tokenizer, seed)
    return str(path)


def save_initialised(path: Path, auto_class: Any, config: PretrainedConfig, tokenizer: Any,
                     seed: int) -> None:
    """Initialise ``auto_class.from_config(config)`` (fp32) under ``seed`` and save it with ``tokenizer``.

    The global RNG state is left untouched; the generation config carries the tokenizer's special ids.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto_class.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
