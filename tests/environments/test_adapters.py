"""The environment adapters (gymnasium, OpenEnv, reasoning-gym): contracts checked directly, then 2 GRPO
steps on each in one spawned rank (the environments of ``text_envs``; a random tiny model)."""

from __future__ import annotations

import pytest

from tests.environments.text_envs import (
    GYM_ID,
    RG_PATH,
    GuessDigitAdapter,
    ServedGuessDigit,
    client_adapter,
    fit_adapters,
)
from verl_trainer.agents.config import MultiTurnConfig
from verl_trainer.algorithms.data import DataConfig
from verl_trainer.data.prompts import save_rows
from verl_trainer.environments.episodes import EpisodeMismatchError
from verl_trainer.environments.gymnasium import GymnasiumEnvironment, gymnasium_rows
from verl_trainer.environments.openenv import openenv_rows
from verl_trainer.environments.reasoning_gym import reasoning_gym_rows, score
from verl_trainer.models import make_tiny_model
from verl_trainer.testing import run_distributed


def _play(env, row, messages):
    env.reset(row)
    try:
        return [env.step(m) for m in messages]
    finally:
        env.close()


def test_gymnasium_episodes_replay_their_seed_and_step_as_text():
    rows = gymnasium_rows(GYM_ID, [11, 12])
    assert rows[0]["prompt"] == [{"role": "user", "content": "Game 11: guess the digit (0-9)."}]
    digits = "0123456789"
    first = _play(GymnasiumEnvironment(), rows[0], ["x" * 30, "none", digits])
    assert first[0].observation.startswith("invalid action") and not first[0].done  # outside the Text space
    assert (first[1].observation, first[1].reward, first[1].done) == ("no, try again", 0.0, False)
    assert (first[2].reward, first[2].done) == (1.0, True)
    lost = _play(GymnasiumEnvironment(), rows[1], ["a", "b", "c"])
    assert [r.done for r in lost] == [False, False, True] and sum(r.reward for r in lost) == 0.0
    forged = {**rows[0], "extra_info": {"gymnasium": {**rows[0]["extra_info"]["gymnasium"], "seed": 12}}}
    with pytest.raises(EpisodeMismatchError, match="deterministic"):
        GymnasiumEnvironment().reset(forged)
    with pytest.raises(ValueError, match="register it"):
        gymnasium_rows("NoSuchTextEnv-v0", [0])


def test_openenv_in_process_episodes_replay_their_seed():
    rows = openenv_rows(GuessDigitAdapter, [5, 6, 7])
    assert rows[2]["prompt"][0]["content"] == "Game 7: guess the digit (0-9)."
    results = _play(GuessDigitAdapter(), rows[0], ["no digit", "0123456789"])
    assert [(r.observation, r.reward, r.done) for r in results] == [("no, try again", 0.0, False),
                                                                     ("", 1.0, True)]


def test_reasoning_gym_splits_are_disjoint_seeded_and_scored_by_the_task():
    train, val = (reasoning_gym_rows(RG_PATH.format(split=s)) for s in ("train", "val"))
    questions = [{r["extra_info"]["question"] for r in rows} for rows in (train, val)]
    assert questions[0] and questions[1] and not questions[0] & questions[1]
    assert reasoning_gym_rows(RG_PATH.format(split="train")) == train  # seeded
    sft = reasoning_gym_rows(RG_PATH.format(split="sft"))
    assert [s["response"] for s in sft] == [r["reward_model"]["ground_truth"] for r in train]
    row = val[0]
    truth, extra = row["reward_model"]["ground_truth"], row["extra_info"]
    assert score(row["data_source"], f" {truth}", truth, extra) == {"score": 1.0, "acc": 1.0}
    assert score(row["data_source"], f"<answer>{truth}</answer>", truth, extra)["acc"] == 1.0
    assert score(row["data_source"], "x", truth, extra)["score"] == 0.0


@pytest.mark.parametrize(("path", "match"), [
    ("reasoning_gym:no_such_task", "no task 'no_such_task'.*basic_arithmetic"),
    ("reasoning_gym:basic_arithmetic@test", "split 'test' is unknown"),
    ("reasoning_gym:basic_arithmetic?max_digitz=1", "max_digitz.*not fields.*max_digits"),
    ("reasoning_gym:basic_arithmetic?val_fraction=1", "val_fraction=1.0 must be in"),
    ("reasoning_gym:basic_arithmetic?size", "not key=value"),
])
def test_bad_reasoning_gym_paths_fail_when_the_config_is_built(path, match):
    with pytest.raises(ValueError, match=f"data.train_files: .*{match}"):
        DataConfig(train_files=path)


def test_an_environment_that_is_not_an_environment_is_refused_at_config_time():
    with pytest.raises(ValueError, match="not a subclass"):
        MultiTurnConfig(enable=True, environment="tests.environments.text_envs:GuessDigitOpenEnv")


def test_two_grpo_steps_on_each_adapter(tmp_path):
    model = make_tiny_model(tmp_path / "model", arch="qwen2", hidden_size=32, num_hidden_layers=1, seed=3)
    save_rows(gymnasium_rows(GYM_ID, range(8)), tmp_path / "gym.jsonl")
    save_rows(openenv_rows(GuessDigitAdapter, range(8)), tmp_path / "openenv.jsonl")
    out = run_distributed(fit_adapters, 1, str(model), str(tmp_path), str(tmp_path / "runs"), timeout=600)[0]
    for name in ("gymnasium", "openenv"):
        steps = out[name]
        assert len(steps) == 2, name
        turns = [s["agent/turns"] for s in steps]
        assert max(turns) > 1.0, (name, turns)  # the environment answered and the model went on
        assert all(s["agent/env_errors"] == 0 and s["agent/env_timeouts"] == 0 for s in steps), name
        assert all(s["actor/grad_norm"] >= 0 for s in steps), name
    assert len(out["reasoning_gym"]) == 2 and "reward/mean" in out["reasoning_gym"][0]


def test_openenv_client_sessions_over_a_served_environment_match_in_process():
    with ServedGuessDigit() as url:
        adapter = client_adapter(url)
        rows = openenv_rows(adapter, [5, 6], data_source="guess")
        assert rows == openenv_rows(GuessDigitAdapter, [5, 6], data_source="guess")
        for row in rows:
            messages = ["none", "still none", "0123456789"]
            assert _play(adapter(), row, messages) == _play(GuessDigitAdapter(), row, messages)
