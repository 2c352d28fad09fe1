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

import json
import re
from pathlib import Path
from typing import Any

import torch

from verl_trainer.data.packing import PackedBatch, pack_token_values
from verl_trainer.data.vlm_processor import mm_token_type_ids

__all__ = [
    "VISION_ATTENTION",
    "VISION_TOWER_NAMES",
    "attach_mrope_positions",
    "check_vlm_settings",
    "directory_is_vision_language",
    "freeze_vision_tower",
    "lora_exclusions",
    "vision_tower_name",
    "find_rope_module",
    "is_vision_language",
    "token_types",
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


def token_types(input_ids: torch.Tensor, config: Any) -> torch.Tensor:
    """``mm_token_type_ids`` ``[B, T]`` int32 from a VLM config's placeholder ids.

    0 text, 1 image (``image_token_id``), 2 video (``video_token_id``), as
    ``data.vlm_processor.mm_token_type_ids`` computes them.
    """
    video = getattr(config, "video_token_id", None)
    return mm_token_type_ids(input_ids, config.image_token_id, video).to(torch.int32)


def find_rope_module(model: Any) -> torch.nn.Module:
    """The submodule that owns ``get_rope_index``.

    Looks through FSDP, DeepSpeed and peft wrappers, and forward wrappers that keep the module in
    ``ds_engine`` / ``module``.

    Raises:
        TypeError: ``model`` has no such submodule (not a multimodal-rope model).
    """
    while not isinstance(model, torch.nn.Module):
        inner = getattr(model, "ds_engine", None) or getattr(model, "module", None)
        if inner is None:
            break
        model = inner
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
        ids, token_types(ids, rope_module.config), image_grid_thw=grids, attention_mask=mask.long()
    )  # [3, B, T]
    return pack_token_values(positions.permute(1, 2, 0), packed.seq_lens).permute(1, 0).unsqueeze(1)


def attach_mrope_positions(model: torch.nn.Module, packed: PackedBatch) -> PackedBatch:
    """``packed`` with :attr:`PackedBatch.mrope_position_ids` set (once) when it carries images."""
    if packed.vision is None or packed.mrope_position_ids is not None:
        return packed
    packed.mrope_position_ids = mrope_position_ids(find_rope_module(model), packed)
    return packed


VISION_TOWER_NAMES = ("visual", "vision_tower", "vision_model")
"""Attribute names transformers gives a VLM's vision tower (Qwen2/2.5/3-VL: ``visual``)."""


def vision_tower_name(model: torch.nn.Module) -> str:
    """The qualified name of ``model``'s vision tower (e.g. ``"model.visual"``).

    Raises:
        ValueError: ``model`` has no submodule named like a vision tower (:data:`VISION_TOWER_NAMES`).
    """
    for name, _ in model.named_modules():
        if name.rsplit(".", 1)[-1] in VISION_TOWER_NAMES:
            return name
    raise ValueError(f"{type(model).__name__} has no vision tower (a submodule named one of "
                     f"{VISION_TOWER_NAMES}); freeze_vision_tower and VLM LoRA need one")


def lora_exclusions(model: torch.nn.Module) -> str | None:
    """Peft ``exclude_modules`` (a regex) keeping LoRA off a VLM's vision tower; ``None`` for a text model."""
    if not is_vision_language(getattr(model, "config", None)):
        return None
    return re.escape(vision_tower_name(model)) + r"(\..*)?"


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """Set ``requires_grad=False`` on every vision-tower parameter (before sharding); returns their count."""
    tower = model.get_submodule(vision_tower_name(model))
    tower.requires_grad_(False)
    return sum(p.numel() for p in tower.parameters())


def directory_is_vision_language(model_path: str | None) -> bool | None:
    """Whether the local checkpoint at ``model_path`` is a VLM (``config.json`` has a ``vision_config``).

    ``None`` when there is no local ``config.json`` to read (a hub id, a factory model).
    """
    if not model_path:
        return None
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get("vision_config") is not None


def check_vlm_settings(model_path: str | None, vision_language: bool | None, sp: int,
                       freeze: bool, tp: int = 1, pp: int = 1) -> None:
    """Refuse VLM settings that cannot run, when the model is known to be (or not be) a VLM.

    Raises:
        ValueError: ``sp > 1`` on a VLM (Ulysses splits the packed row by position after the image
            embeddings were scattered into it, and the vision tower would run whole on every SP rank: not
            supported), ``tp > 1`` / ``pp > 1`` on a VLM, or ``freeze_vision_tower`` on a text-only model.
    """
    if vision_language is None:
        return
    if vision_language and sp > 1:
        raise ValueError(
            f"ulysses_sequence_parallel_size={sp} with the vision-language model {model_path!r} is not "
            "supported: the image embeddings are placed into the packed row before Ulysses would split it, "
            "and the vision tower would run on every SP rank's whole set of images (its patch rows are not "
            "sharded); set ulysses_sequence_parallel_size=1 (dp over the ranks instead)")
    if vision_language and (tp > 1 or pp > 1):
        raise ValueError(
            f"tensor_model_parallel_size={tp} / pipeline_model_parallel_size={pp} with the vision-language "
            f"model {model_path!r} is not supported (their plans split the language model's layers only); "
            "set both to 1 and use data parallelism")
    if freeze and not vision_language:
        raise ValueError(
            f"freeze_vision_tower=True but {model_path!r} is not a vision-language model (its config has no "
            "vision_config); set freeze_vision_tower=False")
