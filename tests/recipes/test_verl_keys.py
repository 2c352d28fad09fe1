"""verl's override keys as aliases of ours (issue 16 item 6)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from verl_trainer.configs import GRPORecipeConfig, PPORecipeConfig, SFTRecipeConfig, load_config
from verl_trainer.configs.verl_keys import UNSUPPORTED, VERL_KEYS, _has_key, translate_overrides

ROOT = Path(__file__).resolve().parents[2]
GRPO_YAML = ROOT / "configs" / "grpo.yaml"


def grpo(*overrides: str) -> tuple[GRPORecipeConfig, list[str]]:
    translated, notes = translate_overrides(GRPORecipeConfig, overrides)
    return load_config(GRPORecipeConfig, GRPO_YAML, translated), notes


def test_every_alias_names_a_key_of_some_recipe():
    schemas = (GRPORecipeConfig, PPORecipeConfig, SFTRecipeConfig)
    for verl_key, alias in VERL_KEYS.items():
        assert alias.ours == "" or any(_has_key(s, alias.ours) for s in schemas), (verl_key, alias.ours)


def test_common_verl_command_line_lands_on_our_keys():
    cfg, notes = grpo(
        "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.01", "actor_rollout_ref.rollout.n=5",
        "data.max_response_length=32", "trainer.n_gpus_per_node=2", "trainer.total_training_steps=7",
        "trainer.save_freq=3", "trainer.test_freq=-1", "trainer.logger=['console','wandb']",
        "trainer.project_name=proj", "trainer.experiment_name=exp", "trainer.resume_mode=auto",
        "actor_rollout_ref.model.use_remove_padding=True", "data.train_batch_size=16",
    )
    actor = cfg.algorithm.actor
    assert (actor.ppo_mini_batch_size, actor.optim.lr, actor.engine.micro_batch_size_per_gpu) == (16, 1e-6, 4)
    assert actor.loss.use_kl_loss and actor.loss.kl_loss_coef == 0.01
    assert (cfg.algorithm.rollout.n, cfg.algorithm.rollout.max_new_tokens) == (5, 32)
    t = cfg.trainer
    assert (t.devices, t.max_steps, t.checkpoint.every_n_train_steps, t.val_check_interval) == (2, 7, 3, None)
    assert list(t.logger) == ["wandb"]
    assert (t.project_name, t.experiment_name, t.ckpt_path) == ("proj", "exp", "last")
    assert cfg.data.train_batch_size == 16  # a key both spell the same passes through
    assert grpo("trainer.logger=false")[0].trainer.logger is False  # our own values are left alone
    assert grpo("trainer.logger=console")[0].trainer.logger is False
    assert "trainer.save_freq=3 -> trainer.checkpoint.every_n_train_steps=3" in notes
    assert "trainer.test_freq=-1 -> trainer.val_check_interval=null" in notes


def test_reward_file_keys_combine_and_errors_name_the_fix(tmp_path):
    cfg, _ = grpo(f"custom_reward_function.path={tmp_path / 'r.py'}")
    assert cfg.algorithm.reward.name == f"{tmp_path / 'r.py'}:compute_score"
    cfg, _ = grpo(f"custom_reward_function.path={tmp_path / 'r.py'}", "custom_reward_function.name=score")
    assert cfg.algorithm.reward.name == f"{tmp_path / 'r.py'}:score"
    key = "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"
    with pytest.raises(ValueError, match=f"verl's {key} has no equivalent here: .*ppo_micro_batch_size"):
        grpo(f"{key}=8")
    with pytest.raises(ValueError, match="critic.optim.lr maps to algorithm.critic.optim.lr, which "
                                         "GRPORecipeConfig does not have"):
        grpo("critic.optim.lr=1e-5")
    with pytest.raises(ValueError, match="padding-free .* always on"):
        grpo("actor_rollout_ref.model.use_remove_padding=false")
    with pytest.raises(ValueError, match="'auto' is trainer.ckpt_path=last"):
        grpo("trainer.resume_mode=resume_path")
    translated, _ = translate_overrides(PPORecipeConfig, ["critic.optim.lr=1e-5", "trainer.critic_warmup=2"])
    ppo = load_config(PPORecipeConfig, ROOT / "configs" / "ppo.yaml", translated)
    assert (ppo.algorithm.critic.optim.lr, ppo.algorithm.critic.warmup_steps) == (1e-5, 2)
    assert set(UNSUPPORTED)


def test_docs_table_is_current_and_print_config_shows_the_translation():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from verl_keys_table import table
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert (ROOT / "docs" / "verl_keys.md").read_text() == table(), "run python scripts/verl_keys_table.py"
    cmd = [sys.executable, str(ROOT / "recipes" / "grpo.py"), "--print-config", "data.max_response_length=9"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    assert first == "# verl key: data.max_response_length=9 -> algorithm.rollout.max_new_tokens=9"
    assert "max_new_tokens: 9" in out.stdout
