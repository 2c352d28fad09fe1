"""A tiny vision-language model (Qwen2.5-VL), its tokenizer and image processor, built locally (no model hub).

``make_tiny_vlm(path)`` writes a randomly initialised ``Qwen2_5_VLForConditionalGeneration`` (loaded back with
``AutoModelForImageTextToText``), the project's character tokenizer with the vision special tokens added
(:data:`VISION_TOKENS`; their ids are in the model config) and the PIL image processor
(``Qwen2VLImageProcessorPil``: no torchvision) with ``save_pretrained``.

Image arithmetic: the processor cuts an image resized to multiples of ``patch_size * merge_size`` (28
pixels by default) into ``patch_size`` squares; ``image_grid_thw`` ``[1, h, w]`` counts them, and the language
model sees ``h * w / merge_size**2`` image tokens per image (a 56x56 image: grid ``[1, 4, 4]``, 16
patch rows of ``pixel_values``, 4 ``<|image_pad|>`` tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoModelForImageTextToText, PreTrainedTokenizerFast
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from verl_trainer.models.tiny import build_tokenizer, save_initialised

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
"""The vision special tokens, added after the character vocabulary (ids 99..102)."""

PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
MIN_PIXELS = (PATCH_SIZE * MERGE_SIZE) ** 2  # one merged token
MAX_PIXELS = 16 * MIN_PIXELS  # at most 16 image tokens per image (e.g. 112x112)


def build_vlm_tokenizer() -> PreTrainedTokenizerFast:
    """The character tokenizer (``models.tiny.build_tokenizer``) and :data:`VISION_TOKENS`."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    return tokenizer


def build_image_processor(
    min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS
) -> Qwen2VLImageProcessorPil:
    """Qwen2-VL's image processor (PIL backend) with this module's patch, merge and pixel bounds."""
    return Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
    )


def make_tiny_vlm(
    path: str | Path,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    vision_hidden_size: int = 32,
    vision_depth: int = 2,
    vision_num_heads: int = 2,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    **text_overrides: Any,
) -> str:
    """Write a randomly initialised tiny Qwen2.5-VL, its tokenizer and image processor to ``path``.

    Args:
        path: Output directory (created).
        hidden_size: Language-model width (the vision merger projects to it).
        num_hidden_layers: Language-model decoder layers.
        num_attention_heads: Language-model query heads; ``hidden_size // num_attention_heads`` must be even
            (the mrope sections split half the head dimension into temporal, height and width parts).
        num_key_value_heads: Language-model key/value heads.
        vision_hidden_size: Vision-tower width.
        vision_depth: Vision-tower blocks (the last one uses full attention, the others windowed).
        vision_num_heads: Vision-tower attention heads.
        max_position_embeddings: Longest sequence the rotary embedding is configured for.
        seed: Seed of the weight initialisation (the global RNG state is left untouched).
        **text_overrides: Any other language-model config field (e.g. ``intermediate_size``).

    Returns:
        ``str(path)``, ready for ``AutoModelForImageTextToText.from_pretrained`` and
        ``AutoImageProcessor.from_pretrained``.

    Raises:
        ValueError: when the head dimension cannot be split into the three mrope sections.

    """
    half = hidden_size // num_attention_heads // 2
    if hidden_size % num_attention_heads or half < 3:
        raise ValueError(
            f"hidden_size={hidden_size} / num_attention_heads={num_attention_heads} must give an even head "
            "dimension of at least 6 (mrope splits half of it into 3 sections); raise hidden_size"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_vlm_tokenizer()
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in VISION_TOKENS}
    temporal = half - 2 * (half // 3)
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "intermediate_size": 2 * hidden_size,
        "max_position_embeddings": max_position_embeddings,
        "rope_scaling": {"type": "mrope", "mrope_section": [temporal, half // 3, half // 3]},
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "tie_word_embeddings": False,
        **text_overrides,
    }
    vision_config = {
        "depth": vision_depth,
        "hidden_size": vision_hidden_size,
        "intermediate_size": 2 * vision_hidden_size,
        "num_heads": vision_num_heads,
        "out_hidden_size": hidden_size,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "fullatt_block_indexes": [vision_depth - 1],
        "window_size": 2 * PATCH_SIZE * MERGE_SIZE,
    }
    config = AutoConfig.for_model(
        "qwen2_5_vl",
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=False,
    )
    save_initialised(path, AutoModelForImageTextToText, config, tokenizer, seed)
    build_image_processor().save_pretrained(path)
    return str(path)
