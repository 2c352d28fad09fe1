"""Schema batches with images for the vision-language engine tests, and the plain-HF reference on them.

:func:`vlm_batch` builds a padded batch of samples with 0, 1 or 2 random images each (different sizes)
through the real tiny-VLM image processor; :func:`hf_reference_log_probs` runs the plain HF model on each
unpacked row, with its own mrope positions (``mm_token_type_ids``), as the reference.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from tensordict import TensorDict

from verl_trainer.data.packing import make_batch
from verl_trainer.data.vision import model_vision_inputs, pad_vision
from verl_trainer.models.tiny_vlm import (
    IMAGE_PAD,
    MERGE_SIZE,
    VISION_END,
    VISION_START,
    build_image_processor,
    build_vlm_tokenizer,
)
from verl_trainer.models.vlm import token_types

SIZES = ((56, 56), (84, 56), (56, 112))
"""Image (width, height) choices: 4, 6 and 8 image tokens."""


def random_image(seed: int | np.random.Generator, size: int | tuple[int, int] = 56) -> Image.Image:
    """An RGB image of uniform random pixels (``size``: a side, or (width, height)); ``seed``: int or RNG."""
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    w, h = (size, size) if isinstance(size, int) else size
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def vlm_batch(batch_size: int = 8, seed: int = 0, max_images: int = 2,
              sizes: tuple[tuple[int, int], ...] = SIZES) -> TensorDict:
    """A schema batch (``make_batch``) with ``pixel_values`` / ``image_grid_thw`` per sample.

    Sample ``i`` has ``i % (max_images + 1)`` images placed in its prompt between random characters,
    random sizes from ``sizes`` (width, height), and a random response of 2..8 characters.
    """
    tok, proc = build_vlm_tokenizer(), build_image_processor()
    rng = np.random.default_rng(seed)
    chars = list("abcdefghijklmnopqrstuvwxyz")
    prompts, responses, pixels, grids = [], [], [], []
    for i in range(batch_size):
        text = "".join(rng.choice(chars, int(rng.integers(1, 4))))
        sample_pixels, sample_grids = [], []
        for _ in range(i % (max_images + 1)):
            image = random_image(rng, sizes[int(rng.integers(len(sizes)))])
            out = proc(images=[image], return_tensors="pt")
            sample_pixels.append(out["pixel_values"])
            sample_grids.append(out["image_grid_thw"])
            n = int(out["image_grid_thw"].prod()) // MERGE_SIZE**2
            text += VISION_START + IMAGE_PAD * n + VISION_END + "".join(rng.choice(chars, 2))
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
        responses.append(tok("".join(rng.choice(chars, int(rng.integers(2, 9)))),
                             add_special_tokens=False)["input_ids"])
        width = proc.patch_size**2 * proc.temporal_patch_size * 3
        pixels.append(torch.cat(sample_pixels) if sample_pixels else torch.zeros(0, width))
        grids.append(torch.cat(sample_grids) if sample_grids else torch.zeros(0, 3, dtype=torch.long))
    batch = make_batch(prompts, responses, pad_token_id=tok.pad_token_id)
    batch.update(pad_vision(pixels, grids))
    return batch


@torch.no_grad()
def hf_reference_log_probs(model: torch.nn.Module, batch: TensorDict) -> torch.Tensor:
    """``[B, T]`` log-probs of the plain HF VLM, one unpacked row at a time (schema next-token convention).

    Each row runs alone with its own images and ``mm_token_type_ids`` (so the model computes its own
    mrope positions); 0 at each row's first token and at padding.
    """
    out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
    for i in range(batch.batch_size[0]):
        n = int(batch["seq_len"][i])
        ids = batch["input_ids"][i : i + 1, :n]
        row = batch[i : i + 1]
        vision = model_vision_inputs(row)
        logits = model(input_ids=ids, mm_token_type_ids=token_types(ids, model.config),
                       use_cache=False, **vision).logits.float()
        log_probs = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        out[i, 1:n] = log_probs
    return out
