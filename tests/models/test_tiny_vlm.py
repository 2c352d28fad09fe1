"""The tiny Qwen2.5-VL: saved and loaded through the real transformers API, images change its output."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from verl_trainer.models.tiny_vlm import IMAGE_PAD, VISION_END, VISION_START, make_tiny_vlm
from verl_trainer.testing.vlm_batch import random_image


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = make_tiny_vlm(tmp_path_factory.mktemp("vlm"))
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    return model, AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path)


def _inputs(tokenizer, processor, image):
    pix = processor(images=[image], return_tensors="pt")
    n = int(pix["image_grid_thw"].prod(-1).sum()) // processor.merge_size**2
    enc = tokenizer(f"{VISION_START}{IMAGE_PAD * n}{VISION_END}colour?", return_tensors="pt")
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    mm_types = (enc.input_ids == image_id).int()
    return dict(
        enc,
        pixel_values=pix["pixel_values"],
        image_grid_thw=pix["image_grid_thw"],
        mm_token_type_ids=mm_types,
    )


def test_loads_and_sees_therandom_image(vlm):
    model, tokenizer, processor = vlm
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert "torchvision" not in type(processor).__module__ and "Pil" in type(processor).__name__
    a, b = _inputs(tokenizer, processor, random_image(0)), _inputs(tokenizer, processor, random_image(1))
    assert a["image_grid_thw"].tolist() == [[1, 4, 4]] and a["pixel_values"].shape[0] == 16
    assert int(a["mm_token_type_ids"].sum()) == 4
    with torch.no_grad():
        la, lb = model(**a).logits, model(**b).logits
    assert la.shape == (1, a["input_ids"].shape[1], len(tokenizer))
    assert (la - lb).abs().max() > 1e-4  # the image reaches the language model


def test_mrope_positions_and_generation(vlm):
    model, tokenizer, processor = vlm
    inputs = _inputs(tokenizer, processor, random_image(0))
    pos, _ = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"]
    )
    assert pos.shape == (3, 1, inputs["input_ids"].shape[1])
    assert not torch.equal(pos[1], pos[2])  # height and width positions differ over the 2x2 image tokens
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, inputs["input_ids"].shape[1] + 4)
