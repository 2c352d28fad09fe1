"""A synthetic vision-language task: which colour is the shape? Prompt files for RL, examples for SFT.

Each image is a ``image_size`` x ``image_size`` (default 56: grid ``[1, 4, 4]``, 4 image tokens) plain
light background with one filled shape (circle, square or triangle) of one of :data:`COLOURS`, at a random
place and size; the question is ``"colour?"`` and the answer the colour's name (``"red"``). Only the image
tells the colours apart, so a model that ignores it is right 1 time in ``len(colours)``.

Files (:func:`write_vlm_task`), everything deterministic given the seed:

* ``layout="verl"``: verl's multimodal columns: ``prompt`` ``"<image>colour?"``, ``images`` ``[{"bytes":
  PNG, "path": None}]`` (parquet) or ``[{"bytes": None, "path": absolute PNG path}]`` (jsonl: the PNGs go
  to ``images/`` beside the files), ``reward_model.ground_truth``, ``data_source`` (``"shape_colour"``),
  ``extra_info`` (split, index, colour, shape);
* ``layout="trl"``: TRL's: ``prompt`` a chat ``[{"role": "user", "content": [{"type": "image"},
  {"type": "text", "text": "colour?"}]}]``, ``image`` (one image, as above), ``solution``.

SFT files hold the same prompt and image columns and ``response`` (the answer). The reward is
:func:`verl_trainer.rewards.vision.shape_colour` (registered as ``shape_colour``).
"""

from __future__ import annotations

import io
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from verl_trainer.data.prompts import save_rows, to_verl_row
from verl_trainer.data.vlm_colours import SHAPE_COLOURS

__all__ = ["COLOURS", "LAYOUTS", "SHAPES", "VLMTaskConfig", "draw_shape", "make_vlm_rows", "vlm_sft_rows",
           "write_vlm_task"]

COLOURS = SHAPE_COLOURS
"""The colour names and their RGB values (:data:`verl_trainer.data.vlm_colours.SHAPE_COLOURS`)."""
SHAPES = ("circle", "square", "triangle")
LAYOUTS = ("verl", "trl")
QUESTION = "colour?"
DATA_SOURCE = "shape_colour"


@dataclass
class VLMTaskConfig:
    """What images and rows to generate.

    Attributes:
        num_train: Training rows.
        num_val: Validation rows (other images of the same colours and shapes).
        colours: Names of :data:`COLOURS` to use (the answers).
        shapes: Any of :data:`SHAPES`.
        image_size: Side of the square images in pixels (a multiple of 28 keeps it unresized: 56 -> 4
            image tokens).
        layout: ``"verl"`` or ``"trl"`` (see the module docstring).
        data_source: The ``data_source`` column.
        seed: Seed of every random choice.
    """

    num_train: int = 512
    num_val: int = 64
    colours: tuple[str, ...] = ("red", "green", "blue", "yellow")
    shapes: tuple[str, ...] = SHAPES
    image_size: int = 56
    layout: str = "verl"
    data_source: str = DATA_SOURCE
    seed: int = 0

    def __post_init__(self) -> None:
        self.colours, self.shapes = tuple(self.colours), tuple(self.shapes)
        bad = [c for c in self.colours if c not in COLOURS]
        if bad or len(self.colours) < 2:
            raise ValueError(f"colours={self.colours!r}: choose at least 2 of {sorted(COLOURS)}")
        bad = [s for s in self.shapes if s not in SHAPES]
        if bad or not self.shapes:
            raise ValueError(f"shapes={self.shapes!r}: choose a non-empty subset of {SHAPES}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r}; choose one of {LAYOUTS}")
        if self.image_size < 28:
            raise ValueError(f"image_size={self.image_size} < 28: the image processor's smallest side")
        if self.num_train < 0 or self.num_val < 0:
            raise ValueError(f"num_train={self.num_train} and num_val={self.num_val} must be >= 0")


def draw_shape(colour: str, shape: str, size: int, rng: random.Random) -> Image.Image:
    """A ``size`` x ``size`` RGB image: a light background and one filled ``shape`` in ``colour``.

    The background is a random light grey; the shape's size is a quarter to a half of the image and its
    place random, fully inside the image.
    """
    grey = rng.randint(225, 255)
    image = Image.new("RGB", (size, size), (grey, grey, grey))
    side = rng.randint(size // 4, size // 2)
    x, y = rng.randint(0, size - side), rng.randint(0, size - side)
    box = (x, y, x + side - 1, y + side - 1)
    draw, fill = ImageDraw.Draw(image), COLOURS[colour]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(x + side // 2, y), (x, y + side - 1), (x + side - 1, y + side - 1)], fill=fill)
    return image


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _row(image: dict[str, Any], colour: str, shape: str, split: str, index: int,
         config: VLMTaskConfig) -> dict[str, Any]:
    extra = {"split": split, "index": index, "colour": colour, "shape": shape}
    if config.layout == "verl":
        return {**to_verl_row(f"<image>{QUESTION}", colour, config.data_source, extra, ability="vision"),
                "images": [image]}
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    return {"prompt": prompt, "image": image, "solution": colour, "data_source": config.data_source,
            "extra_info": extra}


def make_vlm_rows(config: VLMTaskConfig, image_dir: str | Path | None = None
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Generate the train and validation rows (see the module docstring for the columns).

    Args:
        config: The task.
        image_dir: Where to write the PNGs and store their absolute paths (for jsonl files); ``None``: the
            PNG bytes are in the rows.

    Returns:
        ``(train_rows, val_rows)``.
    """
    rng = random.Random(config.seed)
    out_dir = Path(image_dir).resolve() if image_dir is not None else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    splits: dict[str, list[dict[str, Any]]] = {"train": [], "val": []}
    for split, count in (("train", config.num_train), ("val", config.num_val)):
        for i in range(count):
            colour, shape = rng.choice(config.colours), rng.choice(config.shapes)
            image = draw_shape(colour, shape, config.image_size, rng)
            if out_dir is None:
                stored: dict[str, Any] = {"bytes": _png(image), "path": None}
            else:
                path = out_dir / f"{split}_{i:05d}.png"
                image.save(path, format="PNG")
                stored = {"bytes": None, "path": str(path)}
            splits[split].append(_row(stored, colour, shape, split, i, config))
    return splits["train"], splits["val"]


def vlm_sft_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """SFT rows from task rows: the prompt and image columns, and ``response`` (the answer)."""
    out = []
    for r in rows:
        answer = r["solution"] if "solution" in r else r["reward_model"]["ground_truth"]
        images = {k: r[k] for k in ("images", "image") if k in r}
        out.append({"prompt": r["prompt"], **images, "response": str(answer)})
    return out


def write_vlm_task(out_dir: str | Path, config: VLMTaskConfig | None = None,
                   fmt: str = "parquet") -> dict[str, Path]:
    """Write ``train``, ``val`` (RL prompts) and ``sft_train``, ``sft_val`` files to ``out_dir``.

    Args:
        out_dir: Output directory (created).
        config: The task; default :class:`VLMTaskConfig()`.
        fmt: ``"parquet"`` (images as PNG bytes in the files) or ``"jsonl"`` (PNG files in
            ``out_dir/images``, their absolute paths in the files).

    Returns:
        ``{"train": path, "val": path, "sft_train": path, "sft_val": path}``.
    """
    if fmt not in ("jsonl", "parquet"):
        raise ValueError(f"fmt={fmt!r}; choose 'jsonl' or 'parquet'")
    config = config or VLMTaskConfig()
    out = Path(out_dir)
    train, val = make_vlm_rows(config, out / "images" if fmt == "jsonl" else None)
    return {
        "train": save_rows(train, out / f"train.{fmt}"),
        "val": save_rows(val, out / f"val.{fmt}"),
        "sft_train": save_rows(vlm_sft_rows(train), out / f"sft_train.{fmt}"),
        "sft_val": save_rows(vlm_sft_rows(val), out / f"sft_val.{fmt}"),
    }
