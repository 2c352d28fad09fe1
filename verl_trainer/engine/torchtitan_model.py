"""Torchtitan's own models built from an HF config: dense Llama 3 and Qwen3, and their HF state-dict adapters.

:func:`titan_model_spec` maps a checkpoint's ``config.json`` to torchtitan's ``Llama3Model.Config`` /
``Qwen3Model.Config`` (built with torchtitan's ``make_gqa_config`` / ``make_ffn_config``), names the model's
parallelize function (``parallelize_llama`` / ``parallelize_qwen3``) and its state-dict adapter
(``Llama3StateDictAdapter`` / ``Qwen3StateDictAdapter``, which convert HF weights in and out, including
Llama's rotary permutation of ``q_proj`` / ``k_proj``). Projections are kept unfused (``fuse_qkv=False``):
the adapters name ``wq`` / ``wk`` / ``wv`` separately, and every parameter then has one HF name.

Parameter initialisers are zeros: every parameter is overwritten by the HF weights before use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RoPE
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.llama3 import Llama3Model, parallelize_llama
from torchtitan.models.llama3.model import Llama3TransformerBlock
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.models.qwen3 import Qwen3Model, parallelize_qwen3
from torchtitan.models.qwen3.model import Qwen3TransformerBlock
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

from verl_trainer.engine.torchtitan_moe import (
    FusedExpertNames,
    check_moe_config,
    is_moe_layer,
    moe_layer_config,
)

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen3_moe")
"""HF ``config.model_type`` values the torchtitan backend builds (torchtitan's Llama 3, Qwen3, Qwen3 MoE)."""

_ZERO_INIT = {"weight": torch.nn.init.zeros_, "bias": torch.nn.init.zeros_}
_ONE_INIT = {"weight": torch.nn.init.ones_}


@dataclass(frozen=True)
class TitanModelSpec:
    """What the engine needs to build, parallelise and convert one torchtitan model.

    Attributes:
        config: torchtitan's model config (``Llama3Model.Config`` / ``Qwen3Model.Config``).
        parallelize: torchtitan's parallelize function of that model (TP, then FSDP2).
        adapter: torchtitan's HF state-dict adapter instance for ``config``.
    """

    config: Any
    parallelize: Callable[..., torch.nn.Module]
    adapter: Any


def check_hf_config(hf_config: Any) -> None:
    """Refuse an HF config torchtitan's Llama 3 / Qwen3 cannot represent exactly.

    Raises:
        ValueError: Naming the model type or the field, what is supported, and the fix.
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"strategy='torchtitan' builds torchtitan's own models for HF model_type in "
            f"{SUPPORTED_MODEL_TYPES}, got model_type={model_type!r}; use a Llama 3 or Qwen3 checkpoint, "
            f"or strategy='fsdp2' (any transformers model)"
        )
    for name in ("attention_bias", "mlp_bias"):
        if getattr(hf_config, name, False):
            raise ValueError(
                f"{model_type} config has {name}=True, but torchtitan's {model_type} projections have no "
                f"bias; use strategy='fsdp2' for this checkpoint"
            )
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError(
            "qwen3 config has use_sliding_window=True, which torchtitan's Qwen3 does not implement; use "
            "strategy='fsdp2' for this checkpoint"
        )
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(
            f"{model_type} config has hidden_act={hf_config.hidden_act!r}; torchtitan's feed-forward is "
            f"SwiGLU ('silu'); use strategy='fsdp2' for this checkpoint"
        )
    _rope_parameters(hf_config)  # raises on an unsupported scaling
    if model_type == "qwen3_moe":
        check_moe_config(hf_config)


def _rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The rotary settings of a transformers 4.x or 5.x config: ``{"rope_theta", "rope_type", ...}``.

    Raises:
        ValueError: For a scaling other than none (and, for Llama, llama3).
    """
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    params = dict(params or {})
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    allowed = ("default", "llama3") if hf_config.model_type == "llama" else ("default",)
    if rope_type not in allowed:
        raise ValueError(
            f"{hf_config.model_type} config has rope_type={rope_type!r}; the torchtitan backend supports "
            f"{allowed} for this model type; use strategy='fsdp2' for this checkpoint"
        )
    params["rope_type"] = rope_type
    return params


def _rope_config(hf_config: Any, head_dim: int) -> RoPE.Config:
    params = _rope_parameters(hf_config)
    common = {"dim": head_dim, "max_seq_len": int(hf_config.max_position_embeddings),
              "theta": float(params["rope_theta"])}
    if hf_config.model_type != "llama":  # Qwen3 (MoE): rotate-half layout, as HF's weights are
        return CosSinRoPE.Config(**common)
    if params["rope_type"] == "llama3":
        return ComplexRoPE.Config(
            **common, scaling="llama", scaling_factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    return ComplexRoPE.Config(**common)  # interleaved: the adapter permutes q_proj / k_proj


def _norm(dim: int, eps: float) -> RMSNorm.Config:
    return RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=_ONE_INIT)


def titan_model_spec(hf_config: Any, inner_attention: Any, device_type: str = "cpu") -> TitanModelSpec:
    """Torchtitan's model config, parallelize function and HF adapter for ``hf_config``.

    Args:
        hf_config: A transformers config of a supported model type (:func:`check_hf_config`).
        inner_attention: The attention kernel's config every layer uses (``engine/torchtitan_cpu.py:
            inner_attention_config``).
        device_type: ``"cpu"`` or ``"cuda"``: the MoE experts' kernel (``engine/torchtitan_moe.py``).

    Raises:
        ValueError: For an unsupported config (see :func:`check_hf_config`).
    """
    check_hf_config(hf_config)
    dim = int(hf_config.hidden_size)
    n_heads = int(hf_config.num_attention_heads)
    n_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or n_heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or dim // n_heads)
    eps = float(hf_config.rms_norm_eps)
    qwen3 = hf_config.model_type in ("qwen3", "qwen3_moe")
    moe = hf_config.model_type == "qwen3_moe"
    block_cls = Qwen3TransformerBlock if qwen3 else Llama3TransformerBlock
    layers = [
        block_cls.Config(
            attention_norm=_norm(dim, eps),
            ffn_norm=_norm(dim, eps),
            attention=make_gqa_config(
                dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                wqkv_param_init=_ZERO_INIT, wo_param_init=_ZERO_INIT, inner_attention=inner_attention,
                fuse_qkv=False, rope=_rope_config(hf_config, head_dim),
                qk_norm=_norm(head_dim, eps) if qwen3 else None,
            ),
            feed_forward=None if moe and is_moe_layer(hf_config, layer) else make_ffn_config(
                dim=dim, hidden_dim=int(hf_config.intermediate_size), w1_param_init=_ZERO_INIT,
                w2w3_param_init=_ZERO_INIT),
            moe=moe_layer_config(hf_config, device_type, _ZERO_INIT)
            if moe and is_moe_layer(hf_config, layer) else None,
        )
        for layer in range(int(hf_config.num_hidden_layers))
    ]
    vocab = int(hf_config.vocab_size)
    model_cls = Qwen3Model if qwen3 else Llama3Model
    config = model_cls.Config(
        dim=dim,
        vocab_size=vocab,
        norm=_norm(dim, eps),
        enable_weight_tying=bool(getattr(hf_config, "tie_word_embeddings", False)),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_ZERO_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_ZERO_INIT),
        layers=layers,
    )
    adapter_cls = Qwen3StateDictAdapter if qwen3 else Llama3StateDictAdapter
    parallelize_fn = parallelize_qwen3 if qwen3 else parallelize_llama
    return TitanModelSpec(config, parallelize_fn, adapter_cls(config, None))


def hf_names(adapter: Any, shapes: dict[str, torch.Size]) -> dict[str, str]:
    """The HF name of every torchtitan parameter name in ``shapes`` (the adapter's ``to_hf`` on meta tensors).

    A name the adapter drops (the tied ``lm_head.weight``) is left out; a grouped expert weight gets its
    transformers 5 fused name (``engine/torchtitan_moe.py: FusedExpertNames``).
    """
    names: dict[str, str] = {}
    for name, shape in shapes.items():
        fused = FusedExpertNames.hf_name(name)
        if fused is not None:
            names[name] = fused
            continue
        converted = adapter.to_hf({name: torch.empty(shape, device="meta")})
        if converted:
            (hf_name,) = converted
            names[name] = hf_name
    return names
