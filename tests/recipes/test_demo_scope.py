"""The demo's warm start, task and validation set apply only to the demo's own model and data; verl's
``trainer.logger`` / ``project_name`` / ``experiment_name`` lines work (issue 29 items 1 and 2).

The config cases go through the recipes' own command-line parsing (``parse_recipe_args``, as
``python recipes/grpo.py ...`` and ``--print-config`` do); the two runs are real recipe processes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from verl_trainer.models.tiny import make_tiny_model
from verl_trainer.recipe_config import GRPORecipeConfig, PPORecipeConfig, parse_recipe_args
from verl_trainer.recipe_config.demo_scope import apply_demo_scope

ROOT = Path(__file__).resolve().parents[2]
DEMO_CONFIGS = [("grpo", GRPORecipeConfig), ("dapo", GRPORecipeConfig), ("dr_grpo", GRPORecipeConfig),
                ("grpo_lora", GRPORecipeConfig), ("ppo", PPORecipeConfig), ("remax", GRPORecipeConfig),
                ("grpo_moe", GRPORecipeConfig)]


def parse(name: str, schema: type, *argv: str):
    return parse_recipe_args(schema, ROOT / "configs" / f"{name}.yaml", list(argv))


@pytest.mark.parametrize(("name", "schema"), DEMO_CONFIGS, ids=[n for n, _ in DEMO_CONFIGS])
def test_the_default_run_keeps_the_demo_and_a_users_model_turns_it_off(name, schema, capsys):
    cfg = parse(name, schema)
    assert cfg.warm_start.enable is True and cfg.task.write_if_missing
    assert cfg.data.val_files == "outputs/data/arithmetic/val.jsonl"
    assert capsys.readouterr().out == ""  # nothing to say about the default run

    cfg = parse(name, schema, "actor_rollout_ref.model.path=/models/Qwen2.5-0.5B")
    out = capsys.readouterr().out
    assert cfg.warm_start.enable is False and cfg.model.path == "/models/Qwen2.5-0.5B"
    assert "note: warm_start: off" in out and "you gave model.path=/models/Qwen2.5-0.5B" in out
    assert cfg.data.val_files == "outputs/data/arithmetic/val.jsonl"  # the demo's task on your model, said
    assert "note: data: the demo's arithmetic task (data.train_files=outputs/data/arithmetic/" in out

    cfg = parse(name, schema, "algorithm.model_path=/models/policy")
    assert cfg.warm_start.enable is False and "you gave algorithm.model_path=/models/policy" in \
        capsys.readouterr().out


def test_a_users_data_turns_off_the_warm_start_the_demo_val_set_and_the_task(capsys):
    cfg = parse("grpo", GRPORecipeConfig, "data.train_files=/data/gsm8k/train.parquet")
    out = capsys.readouterr().out
    assert cfg.warm_start.enable is False and "you gave data.train_files=/data/gsm8k/train.parquet" in out
    assert cfg.data.val_files is None and "note: data.val_files: off (it was the demo's arithmetic" in out
    assert cfg.task.write_if_missing is False  # nothing of the task is read, so nothing is written
    cfg = parse("grpo", GRPORecipeConfig, "data.train_files=/d/train.parquet",
                "data.val_files=/d/val.parquet")
    assert cfg.data.val_files == "/d/val.parquet" and "data.val_files: off" not in capsys.readouterr().out
    assert apply_demo_scope(cfg) == []  # applying it again (as recipes/common.prepare does) changes nothing


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["data.train_files=/d/train.parquet", "warm_start.enable=true"],
         r"warm_start.enable=true would fine-tune model.path=outputs/models/tiny on the demo's arithmetic "
         r"SFT data .* set warm_start.train_files=<your SFT file"),
        (["algorithm.model_path=/m", "warm_start.enable=true"],
         r"the policy starts from algorithm.model_path, so the warm start would not be used"),
        (["warm_start.enable=maybe"], r"warm_start.enable='maybe'; choose true, false or auto"),
    ],
    ids=["users-data", "algorithm-model-path", "bad-value"],
)
def test_an_explicit_warm_start_that_would_not_do_what_it_says_is_refused(argv, match, capsys):
    with pytest.raises(SystemExit):
        parse("grpo", GRPORecipeConfig, *argv)
    assert re.search(match, capsys.readouterr().err)


def test_an_explicit_warm_start_with_your_sft_file_or_the_demo_task_runs(capsys):
    cfg = parse("grpo", GRPORecipeConfig, "model.path=/m", "warm_start.enable=true")  # your model, demo task
    assert cfg.warm_start.enable is True
    cfg = parse("grpo", GRPORecipeConfig, "data.train_files=/d/train.parquet", "warm_start.enable=true",
                "warm_start.train_files=/d/sft.parquet")
    assert cfg.warm_start.enable is True and cfg.task.write_if_missing is False


def test_print_config_shows_the_notes(capsys):
    with pytest.raises(SystemExit) as done:
        parse("dapo", GRPORecipeConfig, "--print-config", "actor_rollout_ref.model.path=/m",
              "trainer.logger=['console']", "trainer.project_name=p", "trainer.experiment_name=e")
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert "# note: warm_start: off" in out and "\n  enable: false\n" in out
    assert ("# note: trainer.project_name=p trainer.experiment_name=e not used: they name the wandb / mlflow "
            "run") in out


def _run(cwd: Path, *args: str) -> str:
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    fast = ["trainer.max_steps=1", "data.train_batch_size=4", "algorithm.rollout.n=2",
            "algorithm.rollout.max_new_tokens=2", "trainer.val_check_interval=null",
            "trainer.validate_before_fit=false", "trainer.enable_checkpointing=false",
            "trainer.export_hf=false"]
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "grpo.py"), *fast, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


@pytest.mark.slow
def test_a_verl_command_line_on_your_model_and_data_runs_rl_only(tmp_path):
    """verl's keys on the user's model and data: RL on them, no warm start, no task written."""
    model = make_tiny_model(tmp_path / "my_model", hidden_size=16, num_attention_heads=2,
                            num_key_value_heads=1)
    data = tmp_path / "my_data.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+1=", "ground_truth": "{i + 1}"}}\n' for i in range(8)))
    work = tmp_path / "work"
    work.mkdir()
    out = _run(work, f"actor_rollout_ref.model.path={model}", f"data.train_files={data}",
               "trainer.logger=['console']", "trainer.project_name=my_project",
               "trainer.experiment_name=exp1",
               f"trainer.default_root_dir={tmp_path / 'run'}")
    assert "note: warm_start: off" in out and "SFT warm start:" not in out
    assert "note: data.val_files: off" in out
    assert "trainer.project_name=my_project trainer.experiment_name=exp1 not used" in out
    assert "wall time:" in out and sorted(p.name for p in work.iterdir()) == []  # no task, no demo model


@pytest.mark.slow
def test_the_demo_warm_start_with_verl_project_and_experiment_names(tmp_path):
    """The demo's own run with verl's logger keys: the warm start (logger=False) no longer crashes, and the
    wandb run carries the names."""
    out = _run(tmp_path, "task.arithmetic.num_train=64", "warm_start.max_steps=1", "warm_start.batch_size=8",
               "trainer.logger=[console,wandb]", "trainer.project_name=my_project",
               "trainer.experiment_name=exp1", "model.tiny.hidden_size=16",
               "model.tiny.num_attention_heads=2",
               "model.tiny.num_key_value_heads=1")
    assert "SFT warm start: 1 steps" in out and "note:" not in out
    runs = list((tmp_path / "outputs" / "grpo" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, out
    record = next(runs[0].glob("run-*.wandb")).read_bytes()  # the run's record holds project and name
    assert b"my_project" in record and b"exp1" in record
