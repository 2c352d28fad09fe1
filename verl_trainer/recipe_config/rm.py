"""The config schemas of ``recipes/rm.py`` (reward-model training) and ``recipes/online_dpo.py``."""

from __future__ import annotations

from dataclasses import dataclass, field

from verl_trainer.algorithms.data import DataConfig
from verl_trainer.algorithms.online_dpo import OnlineDPOConfig
from verl_trainer.algorithms.reward_training import RewardModelTrainingConfig
from verl_trainer.recipe_config.recipes import ModelConfig, TaskConfig, TrainerConfig, WarmStartConfig

__all__ = ["OnlineDPORecipeConfig", "RMRecipeConfig"]


@dataclass
class RMRecipeConfig:
    """``recipes/rm.py``: Bradley–Terry reward-model training.

    ``export_dir`` gets the reward model, a ``*ForSequenceClassification`` directory (default
    ``<default_root_dir>/hf``).
    """

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: RewardModelTrainingConfig = field(default_factory=RewardModelTrainingConfig)
    export_dir: str | None = None


@dataclass
class OnlineDPORecipeConfig:
    """``recipes/online_dpo.py``: the GRPO recipe's sections with online DPO's algorithm."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    algorithm: OnlineDPOConfig = field(default_factory=OnlineDPOConfig)
