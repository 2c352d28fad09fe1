"""Image + text prompts to model inputs: placeholders expanded to image tokens, pixels and grids per sample.

:class:`VisionProcessor` pairs a tokenizer with an image processor (``AutoImageProcessor``; Qwen2-VL's PIL
one needs no torchvision) and turns one prompt and its images into :class:`VisionEncoding`:

* ``input_ids``: the prompt's tokens with each image written as ``<|vision_start|>`` +
  ``<|image_pad|>`` x ``t*h*w / merge_size**2`` + ``<|vision_end|>`` (``t, h, w`` the image's row of
  ``image_grid_thw``; a 56x56 image: grid ``[1, 4, 4]``, 4 image tokens);
* ``pixel_values`` ``[n, D]`` float32: the patch rows of all the prompt's images in order
  (``n = sum(t*h*w)``), ``image_grid_thw`` ``[I, 3]`` long: one row per image (what
  :func:`verl_trainer.data.vision.pad_vision` takes per sample).

An image's place in the prompt is a placeholder: ``<image>`` in the text (verl's layout), an
``{"type": "image"}`` part of a chat message (TRL's and the chat templates' layout), or the
``<|vision_start|><|image_pad|><|vision_end|>`` block a Qwen-VL chat template writes for such a part. A prompt
with images and no placeholder at all gets them in front of its (first user message's) text, as TRL does;
any other count of placeholders than of images is an error. Chat prompts go through the tokenizer's chat
template with their image parts when the template renders them, else with the parts flattened to text
(``<image>`` for an image); the rendered text is expanded, then tokenised once.

:func:`mm_token_type_ids` gives the ``[B, T]`` token types (0 text, 1 image, 2 video) a Qwen2/2.5-VL
forward needs to compute its 3-D mrope positions (without them transformers silently uses 1-D ones).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from verl_trainer.data.vlm_images import load_images

if TYPE_CHECKING:
    from PIL import Image
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "IMAGE_PLACEHOLDER", "VisionEncoding", "VisionProcessor", "count_placeholders", "mm_token_type_ids",
    "PART_TYPES", "check_part_types", "with_images_first",
]

IMAGE_PLACEHOLDER = "<image>"
"""An image's place in prompt text (verl's multimodal layout)."""
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Qwen2/2.5/3-VL's vision special tokens (``verl_trainer.models.tiny_vlm`` uses the same)."""

TEXT, IMAGE, VIDEO = 0, 1, 2
"""Values of :func:`mm_token_type_ids`."""


def mm_token_type_ids(input_ids: torch.Tensor, image_token_id: int,
                      video_token_id: int | None = None) -> torch.Tensor:
    """Token types of ``input_ids`` (any shape), long, same shape.

    1 (:data:`IMAGE`) at ``image_token_id``, 2 (:data:`VIDEO`) at ``video_token_id``, 0 elsewhere.

    Qwen2/2.5-VL's ``get_rope_index`` (transformers 5) places the 3-D mrope positions of the image tokens
    from it; pass it to every forward and to ``generate``.
    """
    types = (input_ids == image_token_id).long()
    if video_token_id is not None:
        types = types + 2 * (input_ids == video_token_id).long()
    return types


def _parts(content: Any) -> list[Mapping[str, Any]] | None:
    """A message content's parts, or ``None`` when it is plain text."""
    if isinstance(content, (list, tuple)) and all(isinstance(p, Mapping) and "type" in p for p in content):
        return list(content)
    return None


def count_placeholders(prompt: str | Sequence[Mapping[str, Any]]) -> int:
    """The images a prompt places: ``<image>`` in its text, ``{"type": "image"}`` parts, vision blocks."""
    block = re.compile(f"{re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VISION_START)}")
    if isinstance(prompt, str):
        return len(block.findall(prompt))
    total = 0
    for message in prompt:
        parts = _parts(message.get("content"))
        if parts is None:
            total += len(block.findall(str(message.get("content", ""))))
            continue
        for part in parts:
            total += 1 if part["type"] == "image" else len(block.findall(str(part.get("text", ""))))
    return total


PART_TYPES = ("text", "image")
"""The content parts a chat message may hold here (a ``video`` part, or any other, is refused)."""


def check_part_types(prompt: str | Sequence[Mapping[str, Any]], where: str) -> None:
    """Fail on a content part of a type other than :data:`PART_TYPES`, naming the message and the type."""
    if isinstance(prompt, str):
        return
    for i, message in enumerate(prompt):
        for part in _parts(message.get("content")) or []:
            if part["type"] not in PART_TYPES:
                raise ValueError(f"{where}: message {i} has a {part['type']!r} content part; the parts read "
                                 f"here are {PART_TYPES} (videos are not supported)")


def with_images_first(prompt: str | list[Mapping[str, Any]], n: int) -> str | list[dict[str, Any]]:
    """``prompt`` with ``n`` images in front of its text (of the first user message in a chat)."""
    if isinstance(prompt, str):
        return IMAGE_PLACEHOLDER * n + prompt
    messages = [dict(m) for m in prompt]
    first = next((i for i, m in enumerate(messages) if m.get("role") == "user"), 0)
    content = messages[first].get("content", "")
    parts = _parts(content) or [{"type": "text", "text": str(content)}]
    messages[first]["content"] = [{"type": "image"} for _ in range(n)] + parts
    return messages


def _flatten(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages with their content parts joined to text (an image part: :data:`IMAGE_PLACEHOLDER`)."""
    out = []
    for m in messages:
        parts = _parts(m.get("content"))
        if parts is not None:
            text = "".join(IMAGE_PLACEHOLDER if p["type"] == "image" else str(p.get("text") or "")
                           for p in parts)
            m = {**m, "content": text}
        out.append(dict(m))
    return out


@dataclass
class VisionEncoding:
    """One prompt with its images, encoded (see the module docstring).

    Attributes:
        input_ids: Token ids with each image's vision block.
        pixel_values: ``[n, D]`` float32 patch rows of every image (``[0, 1]`` without images).
        image_grid_thw: ``[I, 3]`` long, one ``(t, h, w)`` row per image (``[0, 3]`` without images).
        images: The decoded RGB images, in prompt order.
    """

    input_ids: list[int]
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    images: list[Image.Image]


class VisionProcessor:
    """A tokenizer and an image processor: prompts with images to :class:`VisionEncoding`.

    Args:
        tokenizer: The model's tokenizer, holding the vision special tokens.
        image_processor: An ``AutoImageProcessor`` of the Qwen2-VL family (``merge_size``; returns
            ``pixel_values`` and ``image_grid_thw``).

    Raises:
        ValueError: The tokenizer lacks one of the vision tokens (the message names it).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, image_processor: Any) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.merge_size = int(getattr(image_processor, "merge_size", 1) or 1)
        ids = {}
        for token in (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD):
            found = tokenizer.convert_tokens_to_ids(token)
            if found is None or found == tokenizer.unk_token_id:
                raise ValueError(f"the tokenizer has no {token!r} token, so images cannot be placed in "
                                 "prompts; use the vision-language model's own tokenizer (its special tokens "
                                 f"include {VISION_START}, {IMAGE_PAD}, {VISION_END})")
            ids[token] = int(found)
        self.image_token_id, self.video_token_id = ids[IMAGE_PAD], ids[VIDEO_PAD]
        self._template_renders_parts: bool | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path, tokenizer: PreTrainedTokenizerBase | None = None
                        ) -> VisionProcessor:
        """The processor of a model directory: its tokenizer (unless given) and ``AutoImageProcessor``."""
        from transformers import AutoImageProcessor, AutoTokenizer

        tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(str(path))
        return cls(tokenizer, AutoImageProcessor.from_pretrained(str(path)))

    def token_types(self, input_ids: torch.Tensor) -> torch.Tensor:
        """:func:`mm_token_type_ids` with this tokenizer's image and video token ids."""
        return mm_token_type_ids(input_ids, self.image_token_id, self.video_token_id)

    def process_images(self, images: Sequence[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pixel_values [n, D] float32, image_grid_thw [I, 3] long)`` of decoded images.

        The image processor resizes them by its rules (Qwen2-VL: sides rounded to ``patch_size *
        merge_size``, area within ``min_pixels``..``max_pixels``). No images: ``([0, 1], [0, 3])``.
        """
        if not images:
            return torch.zeros(0, 1), torch.zeros(0, 3, dtype=torch.long)
        out = self.image_processor(images=list(images), return_tensors="pt")
        return out["pixel_values"].to(torch.float32), out["image_grid_thw"].to(torch.long).reshape(-1, 3)

    def renders_image_parts(self) -> bool:
        """Whether the tokenizer's chat template writes a vision block or ``<image>`` for an image part."""
        if self._template_renders_parts is None:
            probe = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}]
            try:
                text = self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
            except Exception:  # noqa: BLE001  (a template that cannot take parts: flatten them)
                text = ""
            self._template_renders_parts = IMAGE_PAD in text or IMAGE_PLACEHOLDER in text
        return self._template_renders_parts

    def render(self, prompt: str | Sequence[Mapping[str, Any]], chat_template: bool | None = None,
               add_generation_prompt: bool = True) -> str:
        """The prompt's text, image placeholders not yet expanded.

        ``chat_template`` as in :func:`verl_trainer.data.prompts.encode_prompt`: ``None`` templates chat
        lists only, ``True`` wraps a string as one user message, ``False`` joins messages as
        ``"role: content"`` lines. ``add_generation_prompt``: the template's (a prompt: ``True``).
        """
        use_template = not isinstance(prompt, str) if chat_template is None else chat_template
        if not use_template:
            if isinstance(prompt, str):
                return prompt
            return "".join(f"{m['role']}: {m['content']}\n" for m in _flatten(prompt))
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat_template; set data.chat_template=false or give one")
        if not self.renders_image_parts():
            messages = _flatten(messages)
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)

    def chat_ids(self, messages: Sequence[Mapping[str, Any]], image_grid_thw: torch.Tensor,
                 add_generation_prompt: bool, where: str = "prompt") -> list[int]:
        """Token ids of chat ``messages`` through the chat template, their images expanded.

        ``image_grid_thw`` holds the grids of the conversation's images; ``messages`` (e.g. a prefix of the
        conversation) use the first ones, as many as they place.
        """
        grids = image_grid_thw[: count_placeholders(messages)]
        text = self.expand(self.render(messages, True, add_generation_prompt), grids, where)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def expand(self, text: str, image_grid_thw: torch.Tensor, where: str = "prompt") -> str:
        """``text`` with its i-th placeholder (``<image>`` or a vision block) replaced by image i's block.

        Raises:
            ValueError: The placeholders do not match the images in number.
        """
        block = re.compile("|".join(re.escape(s) for s in (
            VISION_START + IMAGE_PAD + VISION_END, VISION_START + VISION_END, IMAGE_PLACEHOLDER)))
        pieces = block.split(text)
        if len(pieces) - 1 != image_grid_thw.shape[0]:
            raise ValueError(f"{where}: {len(pieces) - 1} image placeholders ({IMAGE_PLACEHOLDER!r} or image "
                             f"parts) for {image_grid_thw.shape[0]} images; give one placeholder per image")
        tokens = [int(g.prod()) // self.merge_size**2 for g in image_grid_thw]
        out = [pieces[0]]
        for n, piece in zip(tokens, pieces[1:]):
            out += [VISION_START, IMAGE_PAD * n, VISION_END, piece]
        return "".join(out)

    def encode(self, prompt: str | Sequence[Mapping[str, Any]], images: Sequence[Any] = (),
               where: str = "prompt", chat_template: bool | None = None) -> VisionEncoding:
        """Encode one prompt and its images (see the module docstring).

        Args:
            prompt: Text with ``<image>`` placeholders, or chat messages (content a string or parts).
            images: The prompt's images in order: PIL images, bytes, paths or ``{"bytes", "path"}`` dicts
                (decoded here, once).
            where: What error messages call the prompt (``"train.parquet: prompt row 3"``).
            chat_template: See :meth:`render`.

        Raises:
            ImageError: An image that cannot be read.
            ValueError: Placeholders and images that differ in number, a content part other than text or
                image, or a tokenizer that splits the vision tokens (the image tokens counted in
                ``input_ids`` differ from the grids').
        """
        check_part_types(prompt, where)
        decoded = load_images(images, where)
        placed = count_placeholders(prompt)
        if decoded and placed == 0:
            prompt = with_images_first(prompt, len(decoded))
        elif placed != len(decoded):
            raise ValueError(f"{where}: the prompt has {placed} image placeholders ({IMAGE_PLACEHOLDER!r} "
                             f"or image parts) for {len(decoded)} images; give one per image, or none to "
                             "put the images before the text")
        pixel_values, grids = self.process_images(decoded)
        text = self.expand(self.render(prompt, chat_template), grids, where)
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        expected = int(grids.prod(-1).sum()) // self.merge_size**2
        if sum(i == self.image_token_id for i in ids) != expected:
            raise ValueError(f"{where}: {sum(i == self.image_token_id for i in ids)} {IMAGE_PAD} tokens in "
                             f"the ids for {expected} image tokens of the grids {grids.tolist()}; the "
                             "tokenizer must keep the vision tokens whole (special tokens)")
        return VisionEncoding(ids, pixel_values, grids, decoded)

