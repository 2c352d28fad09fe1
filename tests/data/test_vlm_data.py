"""Prompts and SFT rows with images: both layouts, chat parts, placeholders = grid tokens, errors, rewards."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from verl_trainer.data import schema
from verl_trainer.data.prompts import PromptDataset, save_rows, to_verl_row
from verl_trainer.data.sft import SFTDataset
from verl_trainer.data.vlm_images import ImageError
from verl_trainer.data.vlm_processor import VisionProcessor, mm_token_type_ids
from verl_trainer.data.vlm_task import VLMTaskConfig, make_vlm_rows, write_vlm_task
from verl_trainer.models.tiny_vlm import (
    IMAGE_PAD,
    VISION_END,
    VISION_START,
    build_image_processor,
    build_vlm_tokenizer,
)
from verl_trainer.rewards import compute_rewards
from verl_trainer.rewards.vision import colour_of

QWEN_STYLE_TEMPLATE = (  # renders image parts as Qwen2-VL's template does
    "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.fixture(scope="module")
def processor() -> VisionProcessor:
    return VisionProcessor(build_vlm_tokenizer(), build_image_processor())


def _png(colour: tuple[int, int, int], size: tuple[int, int] = (56, 56)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _block(n: int) -> str:
    return VISION_START + IMAGE_PAD * n + VISION_END


def _check_tokens_match_grids(batch, processor: VisionProcessor) -> None:
    image_tokens = (batch[schema.PROMPTS] == processor.image_token_id).sum(-1)
    grid_tokens = batch[schema.IMAGE_GRID_THW].prod(-1).sum(-1) // processor.merge_size**2
    assert torch.equal(image_tokens, grid_tokens)
    rows = batch[schema.PIXEL_VALUES].abs().sum(-1) > 0
    assert torch.equal(rows.sum(-1), batch[schema.IMAGE_GRID_THW].prod(-1).sum(-1))


def test_verl_layout_parquet_bytes_and_jsonl_paths(processor, tmp_path):
    red, wide = _png((255, 0, 0)), _png((0, 0, 255), (112, 56))
    image_file = tmp_path / "wide.png"
    image_file.write_bytes(wide)
    rows = [
        {**to_verl_row("<image>colour?", "red", "vlm", {"i": 0}), "images": [{"bytes": red, "path": None}]},
        {**to_verl_row("<image>and<image>?", "blue", "vlm", {"i": 1}),
         "images": [{"bytes": None, "path": str(image_file)}, {"bytes": red, "path": None}]},
        {**to_verl_row("2+2=", "4", "vlm", {"i": 2}), "images": []},
    ]
    ds = PromptDataset(save_rows(rows, tmp_path / "p.parquet"), processor.tokenizer, 64, processor=processor)
    batch = ds.collate([ds[0], ds[1], ds[2]])
    assert batch[schema.IMAGE_GRID_THW].tolist() == [[[1, 4, 4], [0, 0, 0]], [[1, 4, 8], [1, 4, 4]],
                                                     [[0, 0, 0], [0, 0, 0]]]
    assert batch[schema.PIXEL_VALUES].shape == (3, 48, 1176)
    _check_tokens_match_grids(batch, processor)
    assert processor.tokenizer.decode(ds[1]["input_ids"]) == f"{_block(8)}and{_block(4)}?"
    assert ds[2]["input_ids"] == processor.tokenizer.encode("2+2=", add_special_tokens=False)
    # jsonl with plain paths: the same tokens and pixels
    path_rows = [{**r, "images": [str(image_file)]} for r in rows[1:2]]
    path_rows[0]["images"].append({"image": f"file://{image_file}"})
    from_paths = PromptDataset(save_rows(path_rows, tmp_path / "p.jsonl"), processor.tokenizer, 64,
                               processor=processor)
    assert from_paths[0]["input_ids"] == processor.tokenizer.encode(f"{_block(8)}and{_block(8)}?")
    assert torch.equal(from_paths[0][schema.PIXEL_VALUES][:32], ds[1][schema.PIXEL_VALUES][:32])


def test_trl_layout_chat_parts_through_either_template(processor, tmp_path):
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
    rows = [{"prompt": parts, "image": _png((0, 255, 0)), "solution": "green"},
            {"prompt": [{"role": "user", "content": "colour?"}], "images": [_png((0, 0, 255))],
             "solution": "blue"}]  # no placeholder: the image goes first, as in TRL
    want = f"user: {_block(4)}colour?\nassistant: "
    flat = PromptDataset(rows, processor.tokenizer, 64, processor=processor)
    assert not processor.renders_image_parts()
    assert [processor.tokenizer.decode(flat[i]["input_ids"]) for i in range(2)] == [want, want]
    text_parts = [{"role": "user", "content": [{"type": "text", "text": "2+2="}]}]
    text_only = PromptDataset([{"prompt": text_parts}], processor.tokenizer, 64, processor=processor)
    assert text_only[0]["input_ids"] == processor.tokenizer.encode("user: 2+2=\nassistant: ")
    assert schema.PIXEL_VALUES not in text_only.collate([text_only[0]]).keys()
    qwen_tokenizer = build_vlm_tokenizer()
    qwen_tokenizer.chat_template = QWEN_STYLE_TEMPLATE
    qwen = VisionProcessor(qwen_tokenizer, build_image_processor())
    assert qwen.renders_image_parts()
    assert qwen.render(parts) == f"user: {_block(1)}colour?\nassistant: "
    ds = PromptDataset(rows, qwen_tokenizer, 64, processor=qwen)
    assert [ds[i]["input_ids"] for i in range(2)] == [flat[i]["input_ids"] for i in range(2)]
    _check_tokens_match_grids(ds.collate([ds[0], ds[1]]), qwen)


def test_bad_images_and_placeholders_are_named(processor, tmp_path):
    def load(rows, **kwargs):
        return PromptDataset(rows, processor.tokenizer, 64, name="f.parquet", **kwargs)

    ok = {**to_verl_row("<image>?", "red", "vlm"), "images": [_png((255, 0, 0))]}
    missing = {**ok, "images": [{"bytes": None, "path": str(tmp_path / "nope.png")}]}
    with pytest.raises(ImageError, match=r"f.parquet: prompt row 1, image 0: image file .*nope.png"):
        load([ok, missing], processor=processor)
    with pytest.raises(ImageError, match=r"prompt row 0, image 0: cannot decode the image's 6 bytes"):
        load([{**ok, "images": [b"notpng"]}], processor=processor)
    with pytest.raises(ImageError, match="prompt row 0, image 0: .* is no image"):
        load([{**ok, "images": [{"bytes": None, "path": None}]}], processor=processor)
    with pytest.raises(ImageError, match="prompt row 0 has a 'videos' column: videos are not supported"):
        load([{**ok, "videos": ["clip.mp4"]}], processor=processor)
    video_part = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "?"}]}]
    with pytest.raises(ValueError, match="prompt row 0: message 0 has a 'video' content part"):
        load([{**ok, "prompt": video_part}], processor=processor)
    with pytest.raises(ImageError, match="prompt row 0 has 1 image.*without an image processor"):
        load([ok])
    with pytest.raises(ValueError, match="prompt row 0: the prompt has 2 image placeholders .* for 1 images"):
        load([{**ok, "prompt": "<image><image>?"}], processor=processor)
    with pytest.raises(ValueError, match="with images.* 7 tokens > max_prompt_length=6; truncating"):
        PromptDataset([ok], processor.tokenizer, 6, truncation="left", processor=processor)
    kept = PromptDataset([ok, to_verl_row("?", "4", "vlm")], processor.tokenizer, 6, processor=processor,
                         filter_overlong_prompts=True)
    assert kept.num_filtered == 1 and kept[0]["input_ids"] == processor.tokenizer.encode("?")


def test_mm_token_type_ids_drive_the_models_mrope_positions(processor, tmp_path):
    from transformers import AutoModelForImageTextToText

    from verl_trainer.models.tiny_vlm import make_tiny_vlm

    ids = torch.tensor([[5, 101, 101, 102, 7], [102, 0, 101, 9, 101]])
    assert mm_token_type_ids(ids, 101, 102).tolist() == [[0, 1, 1, 2, 0], [2, 0, 1, 0, 1]]
    model = AutoModelForImageTextToText.from_pretrained(make_tiny_vlm(tmp_path / "m")).eval()
    enc = processor.encode("<image>colour?", [_png((255, 0, 0), (84, 56))])
    input_ids = torch.tensor([enc.input_ids])
    types = processor.token_types(input_ids)
    assert int(types.sum()) == 6 == int(enc.image_grid_thw.prod()) // 4
    vision = {"pixel_values": enc.pixel_values, "image_grid_thw": enc.image_grid_thw}
    positions, _ = model.model.get_rope_index(input_ids, types, image_grid_thw=enc.image_grid_thw)
    with torch.no_grad():
        typed = model(input_ids=input_ids, mm_token_type_ids=types, **vision).logits
        explicit = model(input_ids=input_ids, position_ids=positions, **vision).logits
        untyped = model(input_ids=input_ids, **vision).logits
    torch.testing.assert_close(typed, explicit)
    assert (typed - untyped).abs().max() > 1e-5  # without the types the positions silently differ


def test_images_reach_verl_and_trl_reward_functions(processor):
    rows = [{**to_verl_row("<image>?", None, "shape_colour", {"i": i}), "images": [_png(c)]}
            for i, c in enumerate([(220, 40, 40), (40, 70, 220)])]
    ds = PromptDataset(rows, processor.tokenizer, 64, processor=processor)
    batch = ds.collate([ds[0], ds[1]])[torch.tensor([0, 0, 1, 1])]  # n=2 samples per prompt, as a rollout
    data = schema.non_tensor_lists(batch)
    seen = {}

    def verl_fn(data_source, solution_str, ground_truth, extra_info=None):
        return float(colour_of(extra_info["images"][0]) == solution_str)

    def trl_fn(prompts, completions, images, **kwargs):
        seen["images"] = images
        return [float(colour_of(imgs[0]) == c) for imgs, c in zip(images, completions)]

    texts = ["red", "blue", "blue", "red"]
    args = (texts, data["ground_truth"], data["data_source"])
    for fn in (verl_fn, trl_fn, "shape_colour"):  # shape_colour: no ground truth, reads the image
        scores = compute_rewards(*args, fn, data["extra_info"], columns=data["columns"])
        assert scores.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert [len(x) for x in seen["images"]] == [1, 1, 1, 1] and seen["images"][0][0].mode == "RGB"


def test_sft_rows_with_images(processor, tmp_path):
    red = _png((255, 0, 0))
    rows = [
        {"prompt": "<image>colour?", "response": "red", "images": [red]},
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "red"}]}], "images": [red]},
        {"prompt": "1+1=", "response": "2"},
    ]
    ds = SFTDataset(rows, processor=processor, max_length=64)
    batch = ds.collate([ds[0], ds[1], ds[2]])
    tok = processor.tokenizer
    ids, mask = batch[schema.INPUT_IDS], batch[schema.LOSS_MASK]
    trained = [tok.decode([t for t, m in zip(ids[i].tolist(), mask[i].tolist()) if m]) for i in range(3)]
    assert trained == ["red<eos>", "red\n", "2<eos>"]
    assert tok.decode(ids[0, : 1 + 4 + 1 + 7].tolist()) == f"{_block(4)}colour?"
    assert batch[schema.IMAGE_GRID_THW][:, 0].tolist() == [[1, 4, 4], [1, 4, 4], [0, 0, 0]]
    image_tokens = (ids == processor.image_token_id).sum(-1)
    assert image_tokens.tolist() == [4, 4, 0]
    with pytest.raises(ImageError, match="SFT row 0: the row has images .* without an image processor"):
        SFTDataset(rows[:1], tokenizer=tok)


@pytest.mark.parametrize("layout", ["verl", "trl"])
def test_vlm_task_is_deterministic_and_its_images_show_the_answer(processor, tmp_path, layout):
    config = VLMTaskConfig(num_train=12, num_val=4, layout=layout, seed=3)
    fmt = "parquet" if layout == "verl" else "jsonl"
    paths = write_vlm_task(tmp_path, config, fmt)
    ds = PromptDataset(paths["train"], processor.tokenizer, 64, processor=processor)
    assert [colour_of(it["extra_info"]["images"][0]) for it in ds.items] == [it["ground_truth"] for it in ds]
    assert len({it["ground_truth"] for it in ds}) > 1
    _check_tokens_match_grids(ds.collate(list(ds)), processor)
    sft = SFTDataset(paths["sft_train"], processor=processor, max_length=64)
    assert len(sft) == 12 and all(ex.image_grid_thw.tolist() == [[1, 4, 4]] for ex in sft)
    again, _ = make_vlm_rows(config)
    first, _ = make_vlm_rows(config)
    assert again == first
    with pytest.raises(ValueError, match="layout='x'; choose one of"):
        VLMTaskConfig(layout="x")
