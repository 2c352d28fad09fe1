"""``recipes/distill.py``'s config schema: GRPO's sections, ``algorithm.distill`` and the demo's teacher.

When ``algorithm.distill.teacher.model_path`` is empty the recipe makes the demo's teacher (``teacher``): a
wider tiny model (``teacher.tiny`` at ``teacher.base``), SFT-trained on the task's answers
(``teacher.sft``, reused when its settings, input model and data are unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from verl_trainer.algorithms.data import DataConfig
from verl_trainer.algorithms.distill_config import DistillGRPOConfig
from verl_trainer.recipe_config.recipes import (
    ModelConfig,
    TaskConfig,
    TinyModelConfig,
    TrainerConfig,
    WarmStartConfig,
)

__all__ = ["DistillRecipeConfig", "TeacherRecipeConfig"]


@dataclass
class TeacherRecipeConfig:
    """The demo's teacher, made when ``algorithm.distill.teacher.model_path`` is empty.

    Attributes:
        base: Where its random tiny model is written (when missing or made with other ``tiny`` settings).
        tiny: Its shape (wider than the student's).
        sft: Its SFT on the task's answers (``sft.output`` is the teacher; ``sft.enable`` must be true).
        validate: Validate the teacher on the validation prompts before distilling (its ``val/reward`` is
            printed next to the student's: where the student is heading).
    """

    base: str = "outputs/models/tiny_teacher_base"
    tiny: TinyModelConfig = field(default_factory=lambda: TinyModelConfig(hidden_size=128, seed=1))
    sft: WarmStartConfig = field(default_factory=lambda: WarmStartConfig(
        enable=True, output="outputs/models/distill_teacher", max_steps=300))
    validate: bool = True

    def __post_init__(self) -> None:
        if self.sft.enable is not True:
            raise ValueError(f"teacher.sft.enable={self.sft.enable!r}: the demo's teacher is its SFT output; "
                             "set teacher.sft.enable=true, or give algorithm.distill.teacher.model_path")


@dataclass
class DistillRecipeConfig:
    """``recipes/distill.py``."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    teacher: TeacherRecipeConfig = field(default_factory=TeacherRecipeConfig)
    algorithm: DistillGRPOConfig = field(default_factory=DistillGRPOConfig)
