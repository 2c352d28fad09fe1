"""Structured configs: YAML files in ``configs/`` mapped onto typed dataclasses (OmegaConf).

:func:`load_config` builds a schema from its defaults, a YAML file and ``key=value`` overrides (unknown
keys are errors); :func:`parse_recipe_args` does the same from a recipe's command line. The recipe
schemas are in :mod:`verl_trainer.recipe_config.recipes`.
"""

from verl_trainer.recipe_config.loading import config_to_yaml, load_config, parse_recipe_args
from verl_trainer.recipe_config.recipes import (
    DEMO_MODEL_PATH,
    DPORecipeConfig,
    GRPORecipeConfig,
    ModelConfig,
    PPORecipeConfig,
    SFTRecipeConfig,
    TaskConfig,
    TinyModelConfig,
    TrainerConfig,
    WarmStartConfig,
)

__all__ = [
    "DEMO_MODEL_PATH",
    "DPORecipeConfig",
    "GRPORecipeConfig",
    "ModelConfig",
    "PPORecipeConfig",
    "SFTRecipeConfig",
    "TaskConfig",
    "TinyModelConfig",
    "TrainerConfig",
    "WarmStartConfig",
    "config_to_yaml",
    "load_config",
    "parse_recipe_args",
]
