"""SFT rows with images (the warm start of a vision-language model) and their batch fields.

:class:`~verl_trainer.data.sft.SFTDataset` calls :func:`encode_vision_sft_row` for every row when given a
:class:`~verl_trainer.data.vlm_processor.VisionProcessor` (``processor=``). A row's images are its
``images`` / ``image`` column (or ``image_key``); the formats are the text ones of
:mod:`verl_trainer.data.sft` with image placeholders:

* a pair: ``prompt`` (text with ``<image>``, or chat messages with ``{"type": "image"}`` parts) and a text
  ``response`` / ``completion``; the loss covers the response and the eos;
* TRL's conversational prompt-completion (both message lists) and ``messages`` chats (TRL's VLM SFT
  layout): through the chat template, images expanded; the loss covers the completion / assistant turns.

Images without any placeholder go before the text (of the first user message), as for RL prompts.
:func:`collate_vision_sft` gives the batch's ``pixel_values`` ``[B, P, D]`` and ``image_grid_thw``
``[B, I, 3]`` (:func:`verl_trainer.data.vision.pad_vision`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from verl_trainer.data import schema
from verl_trainer.data.vision import pad_vision
from verl_trainer.data.vlm_images import ImageError, load_images, refuse_videos, row_images
from verl_trainer.data.vlm_processor import (
    VisionProcessor,
    check_part_types,
    count_placeholders,
    with_images_first,
)

if TYPE_CHECKING:
    from verl_trainer.data.sft import TokenMask, TokenPair

__all__ = ["VisionSFTExample", "collate_vision_sft", "encode_vision_sft_row"]


class VisionSFTExample(NamedTuple):
    """One SFT example with images: its tokens, ``pixel_values`` ``[n, D]``, ``image_grid_thw`` ``[I, 3]``."""

    example: TokenPair | TokenMask
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor


def _placed(messages: Any, images: int, where: str) -> list[Any]:
    """Chat messages with one image placeholder per image (images in front when there are none)."""
    check_part_types(messages, where.rstrip(": "))
    placed = count_placeholders(messages)
    if images and not placed:
        return with_images_first(list(messages), images)
    if placed != images:
        raise ValueError(f"{where}the chat has {placed} image placeholders for {images} images; give one "
                         "{'type': 'image'} part (or '<image>') per image, or none")
    return list(messages)


def encode_vision_sft_row(item: Mapping[str, Any], processor: VisionProcessor | None,
                          chat_template: bool | None, keys: tuple[str, str, str], where: str,
                          encoders: tuple[Callable[..., TokenMask], Callable[..., TokenMask]],
                          image_key: str | None = None) -> VisionSFTExample | None:
    """One SFT row with images encoded; ``None`` for a row without images or image placeholders.

    Args:
        item: The row.
        processor: Tokenizer and image processor; ``None`` is an error for a row with images.
        chat_template: See :func:`verl_trainer.data.prompts.encode_prompt` (pair rows).
        keys: ``(prompt_key, response_key, messages_key)``.
        where: Prefix of messages (``"sft.parquet: SFT row 3: "``).
        encoders: ``(encode_chat_example, encode_chat_completion)`` of :mod:`verl_trainer.data.sft` (its
            caller), which tokenise chats with the images' ``render_ids``.
        image_key: The image column (default: ``images``, else ``image``).

    Raises:
        ImageError: Images without a processor, an image that cannot be read, or a video column.
        ValueError: Placeholders and images that differ in number, or columns of no SFT format.
    """
    encode_chat_example, encode_chat_completion = encoders
    prompt_key, response_key, messages_key = keys
    if processor is not None:  # a vision-language model: its rows' videos must not be dropped silently
        refuse_videos(item, where.rstrip(": "))
    images = row_images(item, image_key)
    messages = item.get(messages_key)
    completion_key = response_key if response_key in item else "completion"
    prompt, completion = item.get(prompt_key), item.get(completion_key)
    text = messages if messages is not None else prompt
    if not images and (text is None or not count_placeholders(text)):
        return None
    if processor is None:
        raise ImageError(f"{where}the row has images or image placeholders, but the SFT data is read without "
                         "an image processor: pass processor=VisionProcessor.from_pretrained(model_path) (a "
                         "vision-language model's directory), or remove the images")
    name = where.rstrip(": ")
    if messages is None and isinstance(completion, (str, int, float)) and prompt is not None:
        enc = processor.encode(prompt, images, name, chat_template)
        response = list(processor.tokenizer.encode(str(completion), add_special_tokens=False))
        pair = (enc.input_ids, response + [int(processor.tokenizer.eos_token_id)])
        return VisionSFTExample(pair, enc.pixel_values, enc.image_grid_thw)
    pixel_values, grids = processor.process_images(load_images(images, name))

    def render(msgs: Sequence[Mapping[str, Any]], generation_prompt: bool) -> list[int]:
        return processor.chat_ids(msgs, grids, generation_prompt, name)

    if messages is not None:
        placed = _placed(messages, len(images), where)
        example = encode_chat_example(processor.tokenizer, placed, where, render)
    elif isinstance(prompt, (list, tuple)) and isinstance(completion, (list, tuple)):
        placed = _placed(prompt, len(images), where)
        example = encode_chat_completion(processor.tokenizer, placed, list(completion), where, render)
    else:
        raise ValueError(f"{where}an SFT row with images needs {prompt_key!r} and {response_key!r} (or "
                         f"'completion') columns or a {messages_key!r} chat; it has {sorted(item)}")
    return VisionSFTExample(example, pixel_values, grids)


def collate_vision_sft(items: Sequence[Any]) -> tuple[list[Any], dict[str, torch.Tensor]]:
    """``(the examples without their images, the batch's vision fields)``; ``{}`` without images."""
    if not any(isinstance(it, VisionSFTExample) for it in items):
        return list(items), {}
    empty = torch.zeros(0, 1), torch.zeros(0, 3, dtype=torch.long)
    vision = [(it.pixel_values, it.image_grid_thw) if isinstance(it, VisionSFTExample) else empty
              for it in items]
    fields = pad_vision([v[0] for v in vision], [v[1] for v in vision])
    examples = [it.example if isinstance(it, VisionSFTExample) else it for it in items]
    return examples, {schema.PIXEL_VALUES: fields[schema.PIXEL_VALUES],
                      schema.IMAGE_GRID_THW: fields[schema.IMAGE_GRID_THW]}
