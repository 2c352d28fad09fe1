"""configs/*.yaml map onto the recipe dataclasses; key=value overrides; unknown keys are errors."""

from pathlib import Path

import pytest

from verl_trainer.algorithms import GRPOConfig, PPOConfig, SFTConfig
from verl_trainer.algorithms.distill_config import DistillGRPOConfig
from verl_trainer.algorithms.online_dpo import OnlineDPOConfig
from verl_trainer.algorithms.preference import PreferenceConfig
from verl_trainer.algorithms.reward_training import RewardModelTrainingConfig
from verl_trainer.recipe_config import (
    DPORecipeConfig,
    GRPORecipeConfig,
    PPORecipeConfig,
    SFTRecipeConfig,
    config_to_yaml,
    load_config,
    parse_recipe_args,
)
from verl_trainer.recipe_config.distill import DistillRecipeConfig
from verl_trainer.recipe_config.rm import OnlineDPORecipeConfig, RMRecipeConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RECIPES = {"sft": SFTRecipeConfig, "grpo": GRPORecipeConfig, "dr_grpo": GRPORecipeConfig,
           "dapo": GRPORecipeConfig, "ppo": PPORecipeConfig, "grpo_lora": GRPORecipeConfig,
           "grpo_tools": GRPORecipeConfig, "remax": GRPORecipeConfig, "dpo": DPORecipeConfig,
           "distill": DistillRecipeConfig}
RECIPES.update({"rm": RMRecipeConfig, "online_dpo": OnlineDPORecipeConfig})


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_config_loads_into_its_schema(name):
    cfg = load_config(RECIPES[name], CONFIGS / f"{name}.yaml")
    assert isinstance(cfg, RECIPES[name])
    expected = {"sft": SFTConfig, "ppo": PPOConfig, "dpo": PreferenceConfig,
                "distill": DistillGRPOConfig, "rm": RewardModelTrainingConfig,
                "online_dpo": OnlineDPOConfig}.get(name, GRPOConfig)
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


@pytest.mark.parametrize("override, problem", [
    ("trainer.max_steps=[1,2", r"did not find expected ',' or '\]'"),
    ("algorithm.reward.name={a", r"did not find expected ',' or '\}'"),
])
def test_a_malformed_override_names_its_key_and_the_yaml_problem(override, problem):
    key = override.split("=")[0]
    with pytest.raises(ValueError, match=rf"cannot parse the override .*the value of {key} is not valid YAML "
                                         rf"\(.*{problem}.*\); close the bracket or brace, or quote"):
        load_config(GRPORecipeConfig, None, [override])


def test_a_cosine_schedule_too_short_for_its_warmup_names_trainer_max_steps():
    overrides = ["trainer.max_steps=3", "algorithm.actor.optim.warmup_steps=5"]
    with pytest.raises(ValueError, match=r"cosine.*total_training_steps=3, warmup_steps=5.*"
                                         r"set it to trainer.max_steps: give trainer.max_steps > 5"):
        load_config(GRPORecipeConfig, CONFIGS / "grpo.yaml", overrides)


def test_export_dtype_follows_the_precision_or_is_named():
    import torch

    from verl_trainer.recipe_config import TrainerConfig

    assert TrainerConfig(precision="bf16-mixed").export_torch_dtype() is torch.bfloat16  # not fp32 masters
    assert TrainerConfig().export_torch_dtype() is None  # 32-true: as stored
    assert TrainerConfig(export_dtype="fp16").export_torch_dtype() is torch.float16
    with pytest.raises(ValueError, match="trainer.export_dtype='half'; choose auto or one of bf16, bfloat16"):
        load_config(SFTRecipeConfig, CONFIGS / "sft.yaml", ["trainer.export_dtype=half"])


def test_a_linear_schedule_with_warmup_from_the_command_line():
    from verl_trainer.engine.optim import WarmupSchedule

    cfg = load_config(SFTRecipeConfig, CONFIGS / "sft.yaml", [
        "algorithm.optim.lr_scheduler=linear", "algorithm.optim.warmup_steps=1",
        "algorithm.optim.total_training_steps=3"])
    o = cfg.algorithm.optim
    schedule = WarmupSchedule(o.warmup_steps, o.lr_scheduler, o.total_training_steps, o.min_lr_ratio)
    assert [schedule(i) for i in range(4)] == pytest.approx([1.0, 1.0, 0.5, 0.0])
    with pytest.raises(ValueError, match="lr_scheduler='linear' needs total_training_steps > warmup_steps"):
        load_config(SFTRecipeConfig, CONFIGS / "sft.yaml", ["algorithm.optim.lr_scheduler=linear",
                                                           "algorithm.optim.total_training_steps=null"])
