"""Vision-language models in the engine: detection, attention layout, mrope positions of a packed row.

A checkpoint whose config has a ``vision_config`` is a vision-language model (VLM): the ``language_model``
model type loads it with ``AutoModelForImageTextToText`` (``models/loading.py``) instead of
``AutoModelForCausalLM``; nothing else in a config changes. Its language model runs the padding-free
attention, its vision tower sdpa (:func:`vlm_attention`: the tower attends within each image itself).

A packed micro-batch of a VLM carries the model's vision inputs (``PackedBatch.vision``: ``pixel_values``
``[N_patches, D]``, ``image_grid_thw`` ``[num_images, 3]``, from ``data.vision.model_vision_inputs``) and
the 3-D multimodal-rope positions of its tokens (``PackedBatch.mrope_position_ids`` ``[3, 1, N]``).
:func:`mrope_position_ids` computes them with the model's own ``get_rope_index`` on the unpacked (padded)
rows, each row from 0, then packs them like every token field; the forward gets
``position_ids`` ``[4, 1, N]``: the 1-D positions restarting per sample (what transformers reads for
packed text), then the three mrope rows. Without explicit 3-D positions transformers 5 silently falls back
to 1-D positions when ``mm_token_type_ids`` is absent; the engine never relies on that.
"""

from __future__ import annotations

from typing import Any

import torch

from verl_trainer.data.packing import PackedBatch, pack_token_values

__all__ = [
    "VISION_ATTENTION",
    "attach_mrope_positions",
    "find_rope_module",
    "is_vision_language",
    "mm_token_type_ids",
    "mrope_position_ids",
    "vlm_attention",
]

VISION_ATTENTION = "sdpa"
"""The vision tower's attention implementation (it splits its patch rows per image itself)."""


def is_vision_language(config: Any) -> bool:
    """Whether an HF config describes a vision-language model (it has a ``vision_config``)."""
    return getattr(config, "vision_config", None) is not None


def vlm_attention(text_attention: str | None) -> dict[str, str | None]:
    """``attn_implementation`` of a VLM: ``text_attention`` (``None``: sdpa) on text, sdpa on the tower."""
    text = text_attention or "sdpa"
    return {"": text, "text_config": text, "vision_config": VISION_ATTENTION}


def mm_token_type_ids(input_ids: torch.Tensor, config: Any) -> torch.Tensor:
    """Token modality ``[B, T]`` int32: 0 text, 1 image (``image_token_id``), 2 video (``video_token_id``)."""
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == config.image_token_id] = 1
    video = getattr(config, "video_token_id", None)
    if video is not None:
        types[input_ids == video] = 2
    return types


def find_rope_module(model: torch.nn.Module) -> torch.nn.Module:
    """The submodule that owns ``get_rope_index`` (looks through FSDP, DeepSpeed and peft wrappers).

    Raises:
        TypeError: ``model`` has no such submodule (not a multimodal-rope model).
    """
    for module in model.modules():
        if callable(getattr(module, "get_rope_index", None)):
            return module
    raise TypeError(
        f"{type(model).__name__} has no get_rope_index: the engine computes multimodal-rope positions "
        "with the model's own method (Qwen2-VL / Qwen2.5-VL family)"
    )


def mrope_position_ids(rope_module: torch.nn.Module, packed: PackedBatch) -> torch.Tensor:
    """The packed row's 3-D rope positions ``[3, 1, N]``, each sample's from its own unpacked row.

    Args:
        rope_module: From :func:`find_rope_module` (its ``config`` gives the image / video token ids).
        packed: A packed micro-batch with ``packed.vision`` (the images of its samples, in order).

    Returns:
        ``[3, 1, N]`` long: ``get_rope_index`` of the padded rows (``[B, T]``, right-padded, attention mask
        from the sample lengths) at each sample's real tokens.
    """
    ids = packed.unpack(packed.input_ids.reshape(-1))  # [B, T]
    mask = torch.arange(ids.shape[1], device=ids.device)[None, :] < packed.seq_lens.to(ids.device)[:, None]
    grids = packed.vision.get("image_grid_thw")
    positions, _ = rope_module.get_rope_index(
        ids, mm_token_type_ids(ids, rope_module.config), image_grid_thw=grids, attention_mask=mask.long()
    )  # [3, B, T]
    return pack_token_values(positions.permute(1, 2, 0), packed.seq_lens).permute(1, 0).unsqueeze(1)


def attach_mrope_positions(model: torch.nn.Module, packed: PackedBatch) -> PackedBatch:
    """``packed`` with :attr:`PackedBatch.mrope_position_ids` set (once) when it carries images."""
    if packed.vision is None or packed.mrope_position_ids is not None:
        return packed
    packed.mrope_position_ids = mrope_position_ids(find_rope_module(model), packed)
    return packed
