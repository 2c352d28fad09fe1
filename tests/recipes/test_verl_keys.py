"""verl's override keys as aliases of ours (issue 16 item 6)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from verl_trainer.recipe_config import GRPORecipeConfig, PPORecipeConfig, SFTRecipeConfig, load_config
from verl_trainer.recipe_config.verl_keys import UNSUPPORTED, VERL_KEYS, _has_key, translate_overrides

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
    cfg, _ = grpo("reward_model.enable=true", f"reward_model.model.path={tmp_path}",
                  "reward_model.micro_batch_size_per_gpu=4")
    rm = cfg.algorithm.reward.model
    assert rm.enable and rm.path == str(tmp_path) and rm.engine.micro_batch_size_per_gpu == 4
    with pytest.raises(ValueError, match="reward.model.enable=true needs algorithm.reward.model.path"):
        grpo("reward_model.enable=true")
    with pytest.raises(ValueError, match="critic.optim.lr maps to algorithm.critic.optim.lr, which "
                                         "GRPORecipeConfig does not have"):
        grpo("critic.optim.lr=1e-5")
    with pytest.raises(ValueError, match="padding-free .* always on"):
        grpo("actor_rollout_ref.model.use_remove_padding=false")
    with pytest.raises(ValueError, match="resume_mode=resume_path needs trainer.resume_from_path=<step dir>"):
        grpo("trainer.resume_mode=resume_path")
    with pytest.raises(ValueError, match="resume_mode='latest' is not one of verl's modes: 'auto'"):
        grpo("trainer.resume_mode=latest")
    (tmp_path / "step_000004").mkdir()
    (tmp_path / "step_000004" / "trainer_state.pt").write_bytes(b"")  # what the config check looks for
    for order in ((0, 1), (1, 0)):  # verl's pair, in either order, resumes that checkpoint
        pair = ("trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path / 'step_000004'}")
        cfg, notes = grpo(*(pair[i] for i in order))
        assert cfg.trainer.ckpt_path == str(tmp_path / "step_000004")
        assert "trainer.resume_mode=resume_path -> trainer.ckpt_path=<trainer.resume_from_path>" in notes
    with pytest.raises(ValueError, match=r"trainer.logger=\[csv: the list is not closed.*\[csv,wandb\]"):
        grpo("trainer.logger=[csv")  # was silently read as [csv]
    translated, _ = translate_overrides(PPORecipeConfig, ["critic.optim.lr=1e-5", "trainer.critic_warmup=2"])
    ppo = load_config(PPORecipeConfig, ROOT / "configs" / "ppo.yaml", translated)
    assert (ppo.algorithm.critic.optim.lr, ppo.algorithm.critic.warmup_steps) == (1e-5, 2)
    assert set(UNSUPPORTED)


def test_rollout_correction_keys_of_verl_and_trl():
    corr = grpo("algorithm.rollout_correction.rollout_is=sequence",
                "algorithm.rollout_correction.rollout_is_threshold=3.0")[0].algorithm.rollout_correction
    assert (corr.level, corr.mode, corr.threshold) == ("sequence", "truncate", 3.0)
    corr = grpo("algorithm.rollout_is_level=token", "algorithm.rollout_is_mode=mask",
                "algorithm.rollout_is_threshold=2.5", "algorithm.rollout_is_threshold_lower=0.4",
                "actor_rollout_ref.rollout.calculate_log_probs=true")[0].algorithm.rollout_correction
    assert (corr.level, corr.mode, corr.threshold, corr.threshold_lower) == ("token", "mask", 2.5, 0.4)
    corr = grpo("vllm_importance_sampling_mode=sequence_mask", "vllm_importance_sampling_correction=true",
                "vllm_importance_sampling_cap=3.0")[0].algorithm.rollout_correction
    assert (corr.level, corr.mode, corr.threshold) == ("sequence", "mask", 3.0)
    off = grpo("vllm_importance_sampling_mode=token_mask", "vllm_importance_sampling_correction=false")[0]
    assert off.algorithm.rollout_correction.level is None
    assert grpo()[0].algorithm.rollout_correction.level is None  # off by default
    with pytest.raises(ValueError, match="give vllm_importance_sampling_mode too"):
        grpo("vllm_importance_sampling_correction=true")
    with pytest.raises(ValueError, match="mode=mask threshold_lower=<lower>"):
        grpo("algorithm.rollout_correction.rollout_is_threshold=0.5_2.0")
    with pytest.raises(ValueError, match="rollout_rs has no equivalent here: .*mode=mask"):
        grpo("algorithm.rollout_correction.rollout_rs=token_k1")


def test_docs_table_is_current_and_print_config_shows_the_translation():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from verl_keys_table import table
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    doc = (ROOT / "docs" / "verl_keys.md").read_text()
    assert doc.startswith(table()), "run python scripts/verl_keys_table.py (the habits section follows it)"
    cmd = [sys.executable, str(ROOT / "recipes" / "grpo.py"), "--print-config", "data.max_response_length=9"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    assert first == "# verl key: data.max_response_length=9 -> algorithm.rollout.max_new_tokens=9"
    assert "max_new_tokens: 9" in out.stdout


def test_verl_grpo_script_no_op_keys_are_accepted_with_a_note(capsys):
    """The keys verl's GRPO example scripts write with nothing to set here (issue 29 item 5)."""
    from verl_trainer.recipe_config import parse_recipe_args

    cfg = parse_recipe_args(GRPORecipeConfig, GRPO_YAML, [
        "trainer.critic_warmup=0", "algorithm.use_kl_in_reward=False", "reward_model.enable=False",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40"])
    out = capsys.readouterr().out
    assert cfg.algorithm.ref.engine.micro_batch_size_per_gpu == 40
    for key in ("trainer.critic_warmup=0", "algorithm.use_kl_in_reward=False",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40"):
        assert f"verl key: {key} -> (nothing to set: " in out, out
    assert "verl key: reward_model.enable=False -> algorithm.reward.model.enable=False" in out, out
    assert not cfg.algorithm.reward.model.enable
    translated, _ = translate_overrides(PPORecipeConfig, ["trainer.critic_warmup=2"])
    assert translated == ["algorithm.critic.warmup_steps=2"]  # PPO has a critic: a real alias there


def test_every_problem_of_a_command_line_is_in_one_message(capsys):
    from verl_trainer.recipe_config import parse_recipe_args

    with pytest.raises(SystemExit):
        parse_recipe_args(GRPORecipeConfig, GRPO_YAML, [
            "algorithm.use_kl_in_reward=True", "actor_rollout_ref.actor.not_a_key=1", "critic.optim.lr=1e-5",
            "trainer.max_stepz=3", "data.train_batch_size=many"])
    err = capsys.readouterr().err
    assert "5 problems:" in err
    assert "verl's algorithm.use_kl_in_reward=True cannot be honoured: this recipe has no KL penalty" in err
    assert "verl's actor_rollout_ref.actor.not_a_key is not mapped here (the verl keys accepted are listed " \
           "in docs/verl_keys.md" in err
    assert "critic.optim.lr maps to algorithm.critic.optim.lr, which GRPORecipeConfig does not have" in err
    assert "unknown config key 'trainer.max_stepz'" in err and "'data.train_batch_size'" in err


def test_dapo_aliases_and_keys_verl_sets_along_with_one_key():
    cfg, notes = grpo("actor_rollout_ref.actor.entropy_coeff=0.001", "algorithm.filter_groups.enable=True",
                      "reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=2",
                      "reward_model.overlong_buffer.penalty_factor=0.5", "reward_model.reward_manager=dapo",
                      "actor_rollout_ref.actor.loss_scale_factor=4",
                      "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2")
    a = cfg.algorithm
    assert a.actor.loss.entropy_coeff == 0.001 and a.actor.calculate_entropy  # no second key needed
    assert a.dynamic_sampling and a.actor.loss.loss_scale_factor == 4
    assert (a.reward.overlong_buffer.enable, a.reward.overlong_buffer.len) == (True, 2)
    assert a.actor.engine.ulysses_sequence_parallel_size == a.ref.engine.ulysses_sequence_parallel_size == 2
    assert any("the reference inherits it, as in verl" in n for n in notes)
    assert not grpo("actor_rollout_ref.actor.entropy_coeff=0")[0].algorithm.actor.calculate_entropy


def test_verl_balance_batch_switches_on_sequence_balancing(capsys):
    """verl's ``trainer.balance_batch`` is our ``SequenceBalancing`` callback (issue 47 item 3)."""
    from verl_trainer.callbacks.sequence_balancing import SequenceBalancing
    from verl_trainer.recipe_config import parse_recipe_args

    cfg = parse_recipe_args(GRPORecipeConfig, GRPO_YAML, ["trainer.balance_batch=True"])
    out = capsys.readouterr().out
    assert "verl key: trainer.balance_batch=True -> trainer.sequence_balancing=True" in out
    assert cfg.trainer.sequence_balancing
    trainer = cfg.trainer.build(enable_checkpointing=False, logger=False)
    assert sum(isinstance(cb, SequenceBalancing) for cb in trainer.callbacks) == 1
    assert not grpo("trainer.balance_batch=False")[0].trainer.sequence_balancing
    sft = parse_recipe_args(SFTRecipeConfig, ROOT / "configs" / "sft.yaml", ["trainer.balance_batch=true"])
    assert sft.trainer.sequence_balancing


def test_verl_multi_turn_keys_and_its_tool_yaml(tmp_path):
    (tmp_path / "lookup_tool.py").write_text(
        "class Lookup:\n"
        "    def __init__(self, config, tool_schema):\n"
        "        self.config, self.tool_schema = config, tool_schema\n"
        "    async def execute(self, instance_id, parameters, **kwargs):\n"
        "        return self.config['table'].get(parameters['word'], 'unknown'), 0.0, {}\n"
        "    async def calc_reward(self, instance_id, **kwargs):\n"
        "        return 0.0\n")
    schema = ("{type: function, function: {name: lookup, description: Look a word up., parameters: "
              "{type: object, properties: {word: {type: string}}, required: [word]}}}")
    (tmp_path / "tools.yaml").write_text(f"tools:\n  - class_name: {tmp_path}/lookup_tool.py:Lookup\n"
                                         f"    config: {{type: native, table: {{cat: feline}}}}\n"
                                         f"    tool_schema: {schema}\n")
    cfg, notes = grpo("actor_rollout_ref.rollout.multi_turn.enable=true",
                      "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
                      "actor_rollout_ref.rollout.multi_turn.format=hermes",
                      "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=64",
                      f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path}/tools.yaml")
    multi_turn = cfg.algorithm.rollout.multi_turn
    assert (multi_turn.enable, multi_turn.max_turns, multi_turn.tool_call_format,
            multi_turn.max_tool_response_length) == (True, 3, "hermes", 64)
    from verl_trainer.agents import resolve_tools
    [tool] = resolve_tools(multi_turn.tools, multi_turn.tool_config_path)
    assert tool.name == "lookup" and tool.execute("t0", {"word": "cat"}) == "feline"
    assert any("max_assistant_turns" in n and "multi_turn.max_turns" in n for n in notes)
