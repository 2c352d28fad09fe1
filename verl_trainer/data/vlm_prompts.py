"""RL prompt rows with images: their encoding, their images for the reward, their batch fields.

:class:`~verl_trainer.data.prompts.PromptDataset` calls these for every record when given a
:class:`~verl_trainer.data.vlm_processor.VisionProcessor` (``processor=``). A record's images are its image
column (:func:`verl_trainer.data.vlm_images.row_images`: ``images`` / ``image``, or ``image_key``), placed by
the prompt's ``<image>`` placeholders or ``{"type": "image"}`` parts.

**What the batch carries** (:func:`collate_vision`): ``pixel_values`` ``[B, P, D]`` and ``image_grid_thw``
``[B, I, 3]``, zero-padded per sample (:func:`verl_trainer.data.vision.pad_vision`), next to ``prompts``,
whose tokens hold each image's vision block.

**What reward functions get**: the decoded RGB ``PIL.Image`` images of the sample's prompt, in prompt order,

* verl-style functions (``compute_score(data_source, solution_str, ground_truth, extra_info)``):
  ``extra_info["images"]``, a list (:data:`REWARD_IMAGES_KEY`);
* TRL-style functions (``f(prompts, completions, **kwargs)``): the image column by its own name
  (``images=[[img, ...], ...]``, or ``image=[img, ...]`` for TRL's single-image column), as TRL passes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from verl_trainer.data import schema
from verl_trainer.data.vision import pad_vision
from verl_trainer.data.vlm_images import ImageError, image_column, refuse_videos, row_images
from verl_trainer.data.vlm_processor import VisionEncoding, VisionProcessor, count_placeholders

__all__ = ["REWARD_IMAGES_KEY", "collate_vision", "encode_vision_record", "vision_item", "vision_reward_data"]

REWARD_IMAGES_KEY = "images"
"""``extra_info`` entry holding a sample's decoded prompt images for verl-style reward functions."""


def encode_vision_record(record: Mapping[str, Any], processor: VisionProcessor | None, image_key: str | None,
                         chat_template: bool | None, tools: Sequence[Any] | None,
                         name: str) -> VisionEncoding | None:
    """The record's prompt and images encoded; ``None`` for a text-only record (the caller encodes it).

    Text-only: no images and no image placeholder (a chat with typed content parts goes through ``processor``
    when there is one, which renders or joins the parts).

    Raises:
        ImageError: Images or image placeholders without a ``processor``, an image that cannot be read, or a
            video column (not supported).
        ValueError: Placeholders and images that differ in number; tools with images (not supported).
    """
    where = f"{name}: prompt row {record.get('index')}"
    if processor is not None:  # a vision-language model: its rows' videos must not be dropped silently
        refuse_videos(record.get(schema.COLUMNS, {}), where)
    images = row_images(record.get(schema.COLUMNS, {}), image_key)
    placed = count_placeholders(record["prompt"])
    typed = not isinstance(record["prompt"], str) and any(
        isinstance(m.get("content"), list) for m in record["prompt"])
    if not images and not placed and not (typed and processor is not None):
        return None
    if processor is None:
        what = f"{len(images)} image(s)" if images else f"{placed} image placeholder(s) and no image column"
        raise ImageError(f"{where} has {what}, but the prompts are read without an image processor: train a "
                         "vision-language model (its directory holds the image processor; pass "
                         "processor=VisionProcessor.from_pretrained(model_path)), or remove the images")
    if tools:
        raise ValueError(f"{where}: prompts with images cannot also carry tool schemas here; drop the images "
                         "or set algorithm.rollout.multi_turn.tools_in_prompt=false")
    return processor.encode(record["prompt"], images, where, chat_template)


def vision_reward_data(record: Mapping[str, Any], encoding: VisionEncoding,
                       image_key: str | None) -> dict[str, Any]:
    """The record's ``extra_info`` and ``columns`` with its decoded images (see the module docstring).

    ``{}`` for an encoding without images.
    """
    if not encoding.images:
        return {}
    columns = dict(record.get(schema.COLUMNS, {}))
    key = image_column(columns, image_key)
    if key is not None:
        single = not isinstance(columns[key], (list, tuple)) and not hasattr(columns[key], "tolist")
        columns[key] = encoding.images[0] if single and len(encoding.images) == 1 else list(encoding.images)
    extra = {**record.get(schema.EXTRA_INFO, {}), REWARD_IMAGES_KEY: list(encoding.images)}
    return {schema.EXTRA_INFO: extra, schema.COLUMNS: columns}


def vision_item(encoding: VisionEncoding) -> dict[str, torch.Tensor]:
    """A dataset item's vision tensors: ``pixel_values`` ``[n, D]``, ``image_grid_thw`` ``[I, 3]``.

    ``{}`` for an encoding without images (its batch carries no vision fields unless another item's does).
    """
    if not encoding.images:
        return {}
    return {schema.PIXEL_VALUES: encoding.pixel_values, schema.IMAGE_GRID_THW: encoding.image_grid_thw}


def collate_vision(items: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """The batch's ``pixel_values`` ``[B, P, D]`` and ``image_grid_thw`` ``[B, I, 3]``.

    A text-only item gets zero rows; ``{}`` when no item has images.
    """
    if not any(schema.IMAGE_GRID_THW in it for it in items):
        return {}
    empty_pixels, empty_grid = torch.zeros(0, 1), torch.zeros(0, 3, dtype=torch.long)
    return pad_vision([it.get(schema.PIXEL_VALUES, empty_pixels) for it in items],
                      [it.get(schema.IMAGE_GRID_THW, empty_grid) for it in items])
