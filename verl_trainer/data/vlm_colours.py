"""The colours of the synthetic vision-language task (:mod:`verl_trainer.data.vlm_task`), by name.

Kept apart from the task's generator (which needs torch through the prompt files) so that its reward
(:mod:`verl_trainer.rewards.vision`) reads them without loading it.
"""

from __future__ import annotations

__all__ = ["SHAPE_COLOURS"]

SHAPE_COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (230, 200, 40),
    "purple": (140, 50, 170), "orange": (240, 130, 20),
}
"""The colour names and RGB values: far apart, and saturated against the task's grey backgrounds."""
