"""``trainer.total_epochs`` / ``max_epochs`` set the run's length as verl counts it, and the cosine schedule
spans the steps actually run (issue 29 item 6)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.common import read_csv_metrics
from verl_trainer.algorithms.config import PPOConfig
from verl_trainer.engine.config import OptimConfig
from verl_trainer.engine.optim import WarmupSchedule
from verl_trainer.models.tiny import make_tiny_model
from verl_trainer.recipe_config import GRPORecipeConfig, PPORecipeConfig, parse_recipe_args
from verl_trainer.recipe_config.run_length import run_length, with_schedule_length

ROOT = Path(__file__).resolve().parents[2]


def test_run_length_counts_epochs_as_verl_and_the_first_limit_ends_the_run():
    assert run_length(-1, 3, 25) == (75, "run length: trainer.max_epochs=3 x 25 steps per epoch = 75 steps")
    steps, how = run_length(50, 3, 25)
    assert steps == 50 and "trainer.max_steps ends it before trainer.max_epochs=3" in how
    steps, how = run_length(600, 3, 25)
    assert steps == 75 and "ends it before trainer.max_steps=600" in how
    assert run_length(10, None, 25)[0] == 10
    assert run_length(-1, 2, 25, accumulate_grad_batches=2)[0] == 26  # 13 steps per epoch (a partial group)
    assert run_length(-1, 2, 25, limit_train_batches=0.5)[0] == 24
    with pytest.raises(ValueError, match="set trainer.max_steps or trainer.max_epochs"):
        run_length(-1, None, 25)


def test_schedules_that_followed_the_run_length_span_it():
    cosine = OptimConfig(lr_scheduler="cosine", total_training_steps=600)
    cfg = PPOConfig()
    cfg.actor.optim, cfg.critic.optim = cosine, OptimConfig(lr_scheduler="cosine", total_training_steps=-1)
    new, paths = with_schedule_length(cfg, 600, 75)
    assert sorted(paths) == ["actor.optim", "critic.optim"]
    assert new.actor.optim.total_training_steps == new.critic.optim.total_training_steps == 75
    cfg.actor.optim = OptimConfig(lr_scheduler="cosine", total_training_steps=300)  # the user's own: kept
    assert with_schedule_length(cfg, 600, 75)[0].actor.optim.total_training_steps == 300
    with pytest.raises(ValueError, match="nothing set the run's length"):
        WarmupSchedule(0, "cosine", -1)


def test_verl_total_epochs_drops_the_config_files_max_steps_and_total_training_steps_caps_it(capsys):
    cfg = parse_recipe_args(GRPORecipeConfig, ROOT / "configs" / "grpo.yaml", ["trainer.total_epochs=3"])
    assert (cfg.trainer.max_epochs, cfg.trainer.max_steps) == (3, -1)
    assert cfg.algorithm.actor.optim.total_training_steps == -1  # set from the data at start
    assert "the epochs set the run's length" in capsys.readouterr().out
    cfg = parse_recipe_args(PPORecipeConfig, ROOT / "configs" / "ppo.yaml",
                            ["trainer.total_epochs=3", "trainer.total_training_steps=20"])
    assert (cfg.trainer.max_epochs, cfg.trainer.max_steps) == (3, 20)
    assert "the epochs set" not in capsys.readouterr().out
    cfg = parse_recipe_args(GRPORecipeConfig, ROOT / "configs" / "grpo.yaml", ["trainer.max_epochs=2"])
    assert (cfg.trainer.max_epochs, cfg.trainer.max_steps) == (2, -1)  # Lightning's name, the same rule


@pytest.mark.slow
def test_grpo_recipe_with_total_epochs_runs_that_many_epochs_on_one_cosine(tmp_path):
    model = make_tiny_model(tmp_path / "m", hidden_size=16, num_attention_heads=2, num_key_value_heads=1)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+1=", "ground_truth": "{i + 1}"}}\n' for i in range(10)))
    args = [sys.executable, str(ROOT / "recipes" / "grpo.py"), f"actor_rollout_ref.model.path={model}",
            f"data.train_files={data}", "trainer.total_epochs=2", "data.train_batch_size=4",
            "algorithm.rollout.n=2", "algorithm.rollout.max_new_tokens=2", "trainer.logger=[csv]",
            f"trainer.default_root_dir={tmp_path / 'run'}", "trainer.enable_checkpointing=false",
            "trainer.export_hf=false", "trainer.validate_before_fit=false"]
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    # 10 rows / 4 per step = 2 full batches per epoch (verl's len(train_dataloader)), 2 epochs
    assert "run length: trainer.max_epochs=2 x 2 steps per epoch = 4 steps; the lr schedule of " \
           "algorithm.actor.optim spans it" in proc.stdout
    metrics = read_csv_metrics(tmp_path / "run")
    assert sorted(metrics) == [1, 2, 3, 4]
    schedule = WarmupSchedule(0, "cosine", 4, 0.1)  # configs/grpo.yaml: lr 1e-3, min_lr_ratio 0.1
    expected = [1e-3 * schedule(s) for s in range(4)]
    assert [metrics[s]["actor/lr"] for s in (1, 2, 3, 4)] == pytest.approx(expected)
