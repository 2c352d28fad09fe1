"""configs/*.yaml map onto the recipe dataclasses; key=value overrides; unknown keys are errors."""

from pathlib import Path

import pytest

from verl_trainer.algorithms import GRPOConfig, PPOConfig, SFTConfig
from verl_trainer.configs import (
    GRPORecipeConfig,
    PPORecipeConfig,
    SFTRecipeConfig,
    config_to_yaml,
    load_config,
    parse_recipe_args,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RECIPES = {"sft": SFTRecipeConfig, "grpo": GRPORecipeConfig, "dr_grpo": GRPORecipeConfig,
           "dapo": GRPORecipeConfig, "ppo": PPORecipeConfig, "grpo_lora": GRPORecipeConfig}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_config_loads_into_its_schema(name):
    cfg = load_config(RECIPES[name], CONFIGS / f"{name}.yaml")
    assert isinstance(cfg, RECIPES[name])
    expected = {"sft": SFTConfig, "ppo": PPOConfig}.get(name, GRPOConfig)
    assert isinstance(cfg.algorithm, expected)
    assert cfg.data.train_files.startswith(cfg.task.dir)  # ${task.dir} interpolation resolved


def test_overrides_apply_in_order_and_convert_types():
    cfg = load_config(GRPORecipeConfig, CONFIGS / "grpo.yaml", [
        "trainer.max_steps=7", "algorithm.rollout.n=4", "algorithm.actor.optim.lr=5e-4",
        "trainer.logger=[csv]", "data.val_files=null", "task.dir=/tmp/x", "trainer.max_steps=9",
    ])
    assert cfg.trainer.max_steps == 9
    assert cfg.algorithm.rollout.n == 4
    assert cfg.algorithm.actor.optim.lr == 5e-4
    assert cfg.trainer.logger == ["csv"]
    assert cfg.data.val_files is None
    assert cfg.data.train_files == "/tmp/x/train.jsonl"


@pytest.mark.parametrize("override, key", [
    ("trainer.max_step=3", "trainer.max_step"),
    ("algorithm.actor.loss.clip_ratio_hi=0.3", "algorithm.actor.loss.clip_ratio_hi"),
    ("nope=1", "nope"),
])
def test_unknown_override_key_is_an_error(override, key):
    with pytest.raises(ValueError, match=f"unknown config key '{key}'.*valid keys there"):
        load_config(GRPORecipeConfig, CONFIGS / "grpo.yaml", [override])


def test_unknown_yaml_key_is_an_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_steps: 3\n  learning_rate: 0.1\n")
    with pytest.raises(ValueError, match="unknown config key 'trainer.learning_rate' in config file"):
        load_config(GRPORecipeConfig, bad)


def test_bad_values_are_errors():
    with pytest.raises(ValueError, match="algorithm.actor.optim.lr"):
        load_config(GRPORecipeConfig, None, ["algorithm.actor.optim.lr=fast"])
    with pytest.raises(ValueError, match="key=value"):
        load_config(GRPORecipeConfig, None, ["trainer.max_steps"])
    with pytest.raises(ValueError, match="clip_ratio"):  # the dataclass's own validation runs
        load_config(PPORecipeConfig, None, ["algorithm.actor.loss.clip_ratio=0"])


def test_recipe_command_line(capsys):
    cfg = parse_recipe_args(PPORecipeConfig, CONFIGS / "ppo.yaml", ["algorithm.critic.warmup_steps=3"])
    assert cfg.algorithm.critic.warmup_steps == 3
    with pytest.raises(SystemExit):
        parse_recipe_args(PPORecipeConfig, CONFIGS / "ppo.yaml", ["algorithm.critic.warmup=3"])
    assert "unknown config key 'algorithm.critic.warmup'" in capsys.readouterr().err
    assert "warmup_steps: 3" in config_to_yaml(cfg)
