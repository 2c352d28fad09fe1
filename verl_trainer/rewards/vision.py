"""The reward of the synthetic vision-language task (:mod:`verl_trainer.data.vlm_task`): the shape's colour.

``shape_colour`` (verl's signature) scores 1 when the response, stripped and lower-cased, is exactly the
colour's name, else 0 (``acc`` the same). Its ground truth is the row's; a row without one is scored
against the colour read off the prompt's image (:func:`colour_of`), which reward functions receive as
``extra_info["images"]`` (:mod:`verl_trainer.data.vlm_prompts`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from verl_trainer.data.vlm_colours import SHAPE_COLOURS
from verl_trainer.rewards.registry import register_reward

__all__ = ["colour_of", "shape_colour"]

_SATURATED = 60
"""A pixel whose channels differ by more than this is the shape's (the backgrounds are grey)."""


def colour_of(image: Any) -> str:
    """The name in :data:`SHAPE_COLOURS` nearest to most of the image's saturated pixels.

    Raises:
        ValueError: The image has no saturated pixel (no shape).
    """
    def nearest(pixel: tuple[int, ...]) -> str:
        return min(SHAPE_COLOURS, key=lambda n: sum((a - b) ** 2 for a, b in zip(pixel, SHAPE_COLOURS[n])))

    votes = Counter(nearest(p) for p in image.convert("RGB").getdata() if max(p) - min(p) > _SATURATED)
    if not votes:
        raise ValueError("the image has no coloured shape (no saturated pixel) to read the colour from")
    return votes.most_common(1)[0][0]


@register_reward("shape_colour")
def shape_colour(data_source: str, solution_str: str, ground_truth: Any,
                 extra_info: Mapping[str, Any] | None = None) -> dict[str, float]:
    """1 when ``solution_str`` is the colour's name (exact, after strip and lower-case), else 0.

    Raises:
        ValueError: No ground truth and no image in ``extra_info["images"]`` to read it from.
    """
    if ground_truth is None:
        images = (extra_info or {}).get("images") or []
        if not images:
            raise ValueError(f"shape_colour: a {data_source!r} sample has no ground truth and no image in "
                             "extra_info['images']; give the rows reward_model.ground_truth or their images")
        ground_truth = colour_of(images[0])
    correct = float(solution_str.strip().lower() == str(ground_truth).strip().lower())
    return {"score": correct, "acc": correct}
