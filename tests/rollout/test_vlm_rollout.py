"""The HF rollout generates from image+text prompts: with the images, mrope positions, per-sample seeds."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from verl_trainer.data import schema
from verl_trainer.data.prompts import collate_prompts
from verl_trainer.data.vision import model_vision_inputs, pad_vision
from verl_trainer.models.tiny_vlm import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START, make_tiny_vlm
from verl_trainer.rollout import HFRollout, RolloutConfig, build_rollout, resolve_rollout_name
from verl_trainer.testing.vlm_batch import random_image

TEXTS = ("colour?", "how many dots", "shape")


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = make_tiny_vlm(tmp_path_factory.mktemp("vlm"))
    other = make_tiny_vlm(tmp_path_factory.mktemp("vlm_other"), seed=1)
    return path, other, AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path)


def _item(tokenizer, processor, text: str, image: Image.Image | None, index: int):
    """A prompt item and its vision tensors (placeholder expanded by the processor's grid)."""
    if image is None:
        return {"input_ids": tokenizer(text).input_ids, "index": index}, torch.zeros(0, 1176), \
            torch.zeros(0, 3, dtype=torch.long)
    pix = processor(images=[image], return_tensors="pt")
    n = int(pix["image_grid_thw"].prod(-1).sum()) // processor.merge_size**2
    ids = tokenizer(f"{VISION_START}{IMAGE_PAD * n}{VISION_END}{text}").input_ids
    return {"input_ids": ids, "index": index}, pix["pixel_values"], pix["image_grid_thw"]


def _prompt_batch(tokenizer, processor, images, texts=TEXTS):
    parts = [_item(tokenizer, processor, t, im, i) for i, (t, im) in enumerate(zip(texts, images))]
    batch = collate_prompts([p[0] for p in parts], tokenizer.pad_token_id)
    batch.update(pad_vision([p[1] for p in parts], [p[2] for p in parts]))
    return batch


def _config(**kw) -> RolloutConfig:
    return RolloutConfig(name="hf", max_new_tokens=6, seed=3, **kw)


@pytest.mark.parametrize("decoding", [{"decoding": "drop_finished"}, {"decoding": "generate"},
                                      {"decoding": "generate", "cache_implementation": "static"}],
                         ids=["drop_finished", "generate", "generate_static_cache"])
def test_greedy_equals_plain_generate_and_sees_therandom_image(vlm, decoding):
    path, _, tokenizer, processor = vlm
    images = [random_image(0), random_image(1, size=84), random_image(2)]
    batch = _prompt_batch(tokenizer, processor, images)
    rollout = HFRollout(_config(do_sample=False, **decoding), path)
    out = rollout.generate(batch, step=0)
    assert out[schema.PIXEL_VALUES].shape[0] == 3 and out[schema.IMAGE_GRID_THW][1, 0].tolist() == [1, 6, 6]

    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    for row in range(3):  # each sample alone, through transformers' own generate
        item, pixels, grid = _item(tokenizer, processor, TEXTS[row], images[row], row)
        ids = torch.tensor([item["input_ids"]])
        with torch.no_grad():
            ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels,
                                 image_grid_thw=grid, mm_token_type_ids=(ids == image_id).int(),
                                 max_new_tokens=6, do_sample=False)
        n = int(out[schema.RESPONSE_LEN][row])
        start = int(out[schema.PROMPT_LEN][row])
        assert out[schema.INPUT_IDS][row, start: start + n].tolist() == ref[0, ids.shape[1]:][:n].tolist()
        # the rollout batch keeps the sample's own vision inputs for training
        kept = model_vision_inputs(out[row: row + 1])
        assert torch.equal(kept["pixel_values"], pixels) and torch.equal(kept["image_grid_thw"], grid)

    # the log-probs are the model's with 3-D mrope positions (the silent 1-D fallback would differ), over
    # the vocabulary without the image / video placeholders (never sampled)
    row, start = 0, int(out[schema.PROMPT_LEN][0])
    n = int(out[schema.RESPONSE_LEN][0])
    seq = out[schema.INPUT_IDS][:1, : start + n]
    vision = model_vision_inputs(out[:1])
    placeholders = [image_id, tokenizer.convert_tokens_to_ids(VIDEO_PAD)]

    def log_probs(logits):
        kept = logits[0, start - 1: start + n - 1].index_fill(-1, torch.tensor(placeholders), float("-inf"))
        return torch.log_softmax(kept, -1)

    with torch.no_grad():
        lp = log_probs(model(input_ids=seq, mm_token_type_ids=(seq == image_id).int(), **vision).logits)
        fallback = log_probs(model(input_ids=seq, **vision).logits)
    tokens = seq[0, start: start + n]
    got = out[schema.ROLLOUT_LOG_PROBS][0, start: start + n]
    torch.testing.assert_close(got, lp.gather(-1, tokens[:, None])[:, 0], atol=1e-5, rtol=0)
    assert (fallback - lp).nan_to_num().abs().max() > 1e-4  # (-inf - -inf at the placeholders: 0)

    # another image in the same prompt gives another response: the image reaches generation
    swapped_batch = _prompt_batch(tokenizer, processor, [random_image(5), images[1], images[2]])
    swapped = rollout.generate(swapped_batch, step=0)
    assert not torch.equal(swapped[schema.ROLLOUT_LOG_PROBS][0], out[schema.ROLLOUT_LOG_PROBS][0])


def test_seeded_samples_do_not_depend_on_the_batch(vlm):
    path, _, tokenizer, processor = vlm
    images = [random_image(0), None, random_image(2)]  # a text-only prompt among image prompts
    rollout = HFRollout(_config(do_sample=True, temperature=1.0, n=2, generation_batch_size=3), path)
    full = rollout.generate(_prompt_batch(tokenizer, processor, images), step=4)
    assert full.batch_size[0] == 6 and int(full[schema.IMAGE_GRID_THW][2].abs().sum()) == 0
    alone = rollout.generate(_prompt_batch(tokenizer, processor, images[2:], TEXTS[2:]), step=4,
                             prompt_index=torch.tensor([2]))
    for j in range(2):
        a, b = full[4 + j], alone[j]
        assert a[schema.RESPONSE_LEN] == b[schema.RESPONSE_LEN]
        la, lb = int(a[schema.SEQ_LEN]), int(b[schema.SEQ_LEN])
        assert a[schema.INPUT_IDS][:la].tolist() == b[schema.INPUT_IDS][:lb].tolist()
        torch.testing.assert_close(a[schema.ROLLOUT_LOG_PROBS][:la], b[schema.ROLLOUT_LOG_PROBS][:lb],
                                   atol=1e-5, rtol=0)


def test_weight_sync_reaches_both_towers(vlm):
    path, other, tokenizer, processor = vlm
    batch = _prompt_batch(tokenizer, processor, [random_image(0), random_image(1), random_image(2)])
    rollout = HFRollout(_config(do_sample=False), path)
    state = AutoModelForImageTextToText.from_pretrained(other).state_dict()
    assert any(".visual." in k or k.startswith("visual.") for k in rollout.model.state_dict())
    assert rollout.update_weights(state.items()) == len(rollout.model.state_dict())
    synced = rollout.generate(batch, step=0)
    reference = HFRollout(_config(do_sample=False), other).generate(batch, step=0)
    assert torch.equal(synced[schema.ROLLOUT_LOG_PROBS], reference[schema.ROLLOUT_LOG_PROBS])
    vision_only = {k: v for k, v in state.items() if "visual" in k}
    with pytest.raises(ValueError, match="rollout parameters that were not sent"):
        rollout.update_weights(vision_only.items())


def test_image_token_count_mismatch_is_named(vlm):
    path, _, tokenizer, processor = vlm
    batch = _prompt_batch(tokenizer, processor, [random_image(0), random_image(1, size=84)], TEXTS[:2])
    batch[schema.IMAGE_GRID_THW] = batch[schema.IMAGE_GRID_THW].flip(0)  # row 0 gets row 1's 36-patch grid
    batch[schema.PIXEL_VALUES] = torch.zeros_like(batch[schema.PIXEL_VALUES])
    rollout = HFRollout(_config(do_sample=False), path)
    with pytest.raises(ValueError, match="prompt row 0 holds 4 image tokens"):
        rollout.generate(batch, step=0)


def test_vllm_refuses_a_vision_language_model_before_loading(vlm):
    path = vlm[0]
    with pytest.raises(ValueError, match=r"vision-language model.*torchvision.*rollout.name=hf"):
        build_rollout(RolloutConfig(name="vllm"), path)
    assert resolve_rollout_name("auto", path) == "hf"


@pytest.mark.parametrize("decoding", ["drop_finished", "generate"])
def test_image_placeholders_are_never_sampled(vlm, decoding):
    """A policy that prefers ``<|image_pad|>`` (a +100 logit) still answers in text: a placeholder in a
    response would be read as an image position by the training forward."""
    path, _, tokenizer, processor = vlm
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    rollout = HFRollout(_config(do_sample=True, temperature=1.0, n=2, decoding=decoding), path)
    bias = torch.zeros(len(tokenizer))
    bias[image_id] = 100.0
    rollout.model.lm_head.register_forward_hook(lambda module, args, out: out + bias)
    batch = _prompt_batch(tokenizer, processor, [random_image(0), random_image(1)], TEXTS[:2])
    out = rollout.generate(batch, step=0)
    for row in range(out.batch_size[0]):
        start, n = int(out[schema.PROMPT_LEN][row]), int(out[schema.RESPONSE_LEN][row])
        assert n > 0 and image_id not in out[schema.INPUT_IDS][row, start: start + n].tolist()
