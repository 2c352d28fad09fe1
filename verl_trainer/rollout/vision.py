"""Images in the rollout: per-prompt images out of a prompt batch, into a generation chunk, mrope positions.

A prompt batch with images carries ``schema.PIXEL_VALUES`` ``[B, P, D]`` and ``schema.IMAGE_GRID_THW``
``[B, I, 3]`` per prompt (``data/vision.py``; each image is ``<|vision_start|>`` + ``<|image_pad|>`` x
``t*h*w / merge**2`` + ``<|vision_end|>`` inside the prompt ids). :func:`prompt_images` splits them into one
:class:`PromptImages` per prompt; a backend gathers a chunk's with :func:`chunk_vision_inputs` into the
model's form — ``pixel_values`` ``[N, D]``, ``image_grid_thw`` ``[num_images, 3]`` and ``mm_token_type_ids``
``[b, T]`` (0 text, 1 image: without it transformers' Qwen-VL models fall back to 1-D positions silently) —
and :func:`mrope_positions` gives the 3-D rotary positions of a left-padded prompt chunk (the model's own
``get_rope_index``) and the position of each row's first new token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tensordict import TensorDict
from transformers import PreTrainedModel

from verl_trainer.data.vision import sample_images
from verl_trainer.models.vlm import token_types


@dataclass(frozen=True)
class PromptImages:
    """One prompt's images.

    ``pixel_values`` ``[n, D]``: its patch rows in prompt order; ``image_grid_thw`` ``[I, 3]``:
    ``n = sum(t * h * w)`` (``I = 0``: a prompt without images).
    """

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor


def prompt_images(batch: TensorDict) -> list[PromptImages] | None:
    """Each prompt's images (``data.vision.sample_images``); ``None`` when the batch carries none.

    Raises:
        schema.BatchSchemaError: only one of the two vision fields is present.
    """
    images = sample_images(batch)
    return None if images is None else [PromptImages(pixels, grids) for pixels, grids in images]


def image_token_id(model: PreTrainedModel) -> int:
    """The id of the image placeholder token (``config.image_token_id``).

    Raises:
        ValueError: the model's config names none (not a vision-language model).
    """
    token = getattr(model.config, "image_token_id", None)
    if token is None:
        raise ValueError(
            f"prompts carry images but the rollout model {type(model).__name__} has no "
            "config.image_token_id: it is not a vision-language model; load a VLM checkpoint "
            "(e.g. Qwen2.5-VL) as the policy")
    return int(token)


def placeholder_ids(model: PreTrainedModel) -> list[int]:
    """A vision-language model's image and video placeholder ids; ``[]`` for a text model.

    ``config.image_token_id`` / ``config.video_token_id``.

    The rollout never samples them: the training forward reads every ``image_token_id`` in a sequence as an
    image position (``mm_token_type_ids``, the placeholder mask), so one in a response would fail it or
    take another image's features.
    """
    if getattr(model.config, "vision_config", None) is None:
        return []
    ids = (getattr(model.config, name, None) for name in ("image_token_id", "video_token_id"))
    return sorted({int(i) for i in ids if i is not None})


def chunk_vision_inputs(model: PreTrainedModel, input_ids: torch.Tensor,
                        images: Sequence[PromptImages]) -> dict[str, torch.Tensor]:
    """The model's vision keyword arguments for a left-padded chunk of prompts.

    Args:
        model: The vision-language model (``config.image_token_id``, ``config.vision_config``).
        input_ids: ``[b, T]`` the chunk's prompts.
        images: ``b`` entries, row ``k``'s images.

    Returns:
        ``{"mm_token_type_ids": [b, T] int}`` plus, when any row has an image, ``"pixel_values"``
        ``[N, D]`` and ``"image_grid_thw"`` ``[num_images, 3]`` (rows in order), on ``input_ids.device``.

    Raises:
        ValueError: a row's ``<|image_pad|>`` count is not its grids' ``t*h*w / merge**2`` (naming the row).
    """
    if len(images) != input_ids.shape[0]:
        raise ValueError(f"{len(images)} image entries for {input_ids.shape[0]} prompts; one per prompt")
    token = image_token_id(model)
    merge = int(getattr(model.config.vision_config, "spatial_merge_size", 1))
    is_image = input_ids == token
    for row, im in enumerate(images):
        expected = int(im.image_grid_thw.prod(-1).sum()) // merge**2
        found = int(is_image[row].sum())
        if found != expected:
            raise ValueError(
                f"prompt row {row} holds {found} image tokens but its {im.image_grid_thw.shape[0]} image(s) "
                f"(image_grid_thw {im.image_grid_thw.tolist()}) need {expected} (t*h*w / {merge}**2 each): "
                "expand each image placeholder by the image processor's grid (the VLM data pipeline does)")
    out = {"mm_token_type_ids": token_types(input_ids, model.config)}
    with_rows = [im for im in images if im.image_grid_thw.shape[0]]
    if with_rows:
        out["pixel_values"] = torch.cat([im.pixel_values for im in with_rows]).to(input_ids.device)
        out["image_grid_thw"] = torch.cat([im.image_grid_thw for im in with_rows]).to(input_ids.device)
    return out


def mrope_positions(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    vision: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """3-D rotary positions of a left-padded prompt chunk and each row's next position.

    Args:
        model: A Qwen-VL style model (``model.model.get_rope_index``).
        input_ids: ``[b, T]`` left-padded prompts.
        attention_mask: ``[b, T]`` 1 on prompt tokens.
        vision: :func:`chunk_vision_inputs` of the chunk.

    Returns:
        ``(positions [3, b, T], next_position [b, 1])``: the model's own ``get_rope_index`` positions
        (padding at 0) and one past each row's largest position (every later text token advances all three
        sections together).
    """
    positions, _ = model.model.get_rope_index(
        input_ids, vision["mm_token_type_ids"], image_grid_thw=vision.get("image_grid_thw"),
        attention_mask=attention_mask)
    masked = positions.masked_fill(attention_mask[None] == 0, -1)
    next_position = masked.amax(dim=(0, 2)).unsqueeze(-1) + 1
    return positions, next_position


__all__ = ["PromptImages", "chunk_vision_inputs", "image_token_id", "mrope_positions",
           "placeholder_ids", "prompt_images"]
