"""GRPO trains 2 steps on verifiers environments (single-turn, two-turn) defined here, run by
:class:`~verl_trainer.environments.verifiers.VerifiersAgent` over the token server: every trained response is
exactly the ids verifiers received, and the rubric's reward is the trajectory's reward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

pytest.importorskip("verifiers.legacy", reason="needs verifiers 0.3.x (pip install 'verifiers==0.3.1')")

import verifiers as vf  # noqa: E402
from datasets import Dataset  # noqa: E402

from verl_trainer.environments.verifiers import (  # noqa: E402
    VERIFIERS_INPUT,
    VerifiersAgent,
    require_verifiers,
    verifiers_rows,
)
from verl_trainer.models.tiny import make_tiny_model  # noqa: E402
from verl_trainer.testing import run_distributed  # noqa: E402

QUESTIONS = ("2+3=", "4+4=", "7+1=", "5+2=")
FOLLOW_UP = "Check it."
SEEN: list[dict] = []
"""Per scored rollout: verifiers' completion ids per turn, its first prompt ids and its reward."""


def _dataset() -> Dataset:
    return Dataset.from_dict({"question": list(QUESTIONS),
                              "answer": [str(eval(q[:-1])) for q in QUESTIONS]})  # noqa: S307


def has_digit(completion, state) -> float:
    """1 when the last reply holds a digit; records what verifiers received for the test."""
    steps = state["trajectory"]
    replies = [m for m in completion if m.role == "assistant"]
    reward = float(any(ch.isdigit() for ch in str(replies[-1].content))) if replies else 0.0
    SEEN.append({"turns": [list(s["tokens"]["completion_ids"]) for s in steps], "reward": reward,
                 "prompt": list(steps[0]["tokens"]["prompt_ids"]) if steps else None,
                 "empty_end": isinstance(state.get("error"), vf.EmptyModelResponseError)})
    return reward


def _match(sampled: list[int], eos: int) -> dict | None:
    """The recorded rollout whose turns are ``sampled``; verifiers drops a last turn that is only eos
    (an empty reply ends its rollout with ``EmptyModelResponseError``), the trainer keeps it."""
    for seen in SEEN:
        ids = [t for turn in seen["turns"] for t in turn]
        if ids == sampled or (seen["empty_end"] and [*ids, eos] == sampled):
            return seen
    return None


class FollowUpEnv(vf.MultiTurnEnv):
    """Two turns: the question, then a fixed follow-up the model answers."""

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": FOLLOW_UP}]


class RewritingEnv(vf.MultiTurnEnv):
    """Answers with an assistant message the server did not sample: the server refuses the second turn."""

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "assistant", "content": "made up"}, {"role": "user", "content": FOLLOW_UP}]


def single_turn_env():
    return vf.SingleTurnEnv(dataset=_dataset(), rubric=vf.Rubric(funcs=[has_digit]))


def follow_up_env():
    return FollowUpEnv(dataset=_dataset(), rubric=vf.Rubric(funcs=[has_digit]), max_turns=2)


single_turn_agent = VerifiersAgent(single_turn_env, sampling_args={"max_tokens": 12})
follow_up_agent = VerifiersAgent(follow_up_env, sampling_args={"max_tokens": 12})
rewriting_agent = VerifiersAgent(
    lambda: RewritingEnv(dataset=_dataset(), rubric=vf.Rubric(funcs=[has_digit]), max_turns=2),
    sampling_args={"max_tokens": 12})


def _fit(base: str, name: str, steps: int = 2) -> dict:
    from verl_trainer import Trainer
    from verl_trainer.algorithms import GRPO, PromptDataModule
    from verl_trainer.callbacks import Callback
    from verl_trainer.data import schema
    from verl_trainer.models.loading import load_tokenizer
    from verl_trainer.recipe_config import GRPORecipeConfig, load_config
    from verl_trainer.rollout import AGENT_INFO

    checked, metrics, empty_ends, errors = [], [], [], []
    SEEN.clear()
    tokenizer = load_tokenizer(f"{base}/model")
    eos = tokenizer.eos_token_id

    class Check(Callback):
        def on_rollout_end(self, trainer, module, batch) -> None:
            for i in range(batch.batch_size[0]):
                p, r = int(batch[schema.PROMPT_LEN][i]), int(batch[schema.RESPONSE_LEN][i])
                ids = batch[schema.INPUT_IDS][i, p: p + r].tolist()
                mask = batch[schema.LOSS_MASK][i, p: p + r].tolist()
                sampled = [t for t, m in zip(ids, mask) if m]
                seen = _match(sampled, eos)
                assert seen is not None, (sampled, SEEN)
                assert seen["prompt"] in (None, batch[schema.INPUT_IDS][i, :p].tolist())
                info = batch[AGENT_INFO][i]
                turns = len(seen["turns"]) + int(seen["empty_end"])
                reward = 0.0 if info["env_errors"] else seen["reward"]  # a failed agent scores 0
                assert info["turns"] == turns and info["reward"] == reward, (info, seen)
                empty_ends.append(seen["empty_end"])
            checked.append(batch.batch_size[0])
            SEEN.clear()
            errors.extend(module.rollout.agent_loop.last_errors)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    overrides = [
        f"algorithm.model_path={base}/model", f"data.train_files={base}/train.jsonl",
        f"data.val_files={base}/train.jsonl",
        "data.train_batch_size=4", "data.max_prompt_length=32", "algorithm.rollout.n=2",
        "algorithm.rollout.max_new_tokens=64", "algorithm.actor.ppo_mini_batch_size=4",
        "algorithm.rollout.multi_turn.enable=true",
        f"algorithm.rollout.multi_turn.agent=tests.serving.test_verifiers:{name}",
        "algorithm.reward.name=math",
    ]
    cfg = load_config(GRPORecipeConfig, Path(__file__).resolve().parents[2] / "configs" / "grpo.yaml",
                      overrides)
    trainer = Trainer(devices=dist.get_world_size(), max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      default_root_dir=f"{base}/run-{name}", val_check_interval=None,
                      callbacks=[Check()], seed=7)
    module = GRPO(cfg.algorithm)
    trainer.fit(module, datamodule=PromptDataModule(cfg.data, tokenizer))
    module.rollout.agent_loop.close()
    return {"checked": checked, "metrics": metrics, "empty_ends": sum(empty_ends), "errors": errors}


def fit_both(base: str) -> dict:
    """The environments, one after the other, in one rank (one spawn); the failing one trains 1 step."""
    out = {name: _fit(base, name) for name in ("single_turn_agent", "follow_up_agent")}
    return {**out, "rewriting_agent": _fit(base, "rewriting_agent", steps=1)}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    from verl_trainer.data.prompts import save_rows

    base = tmp_path_factory.mktemp("grpo_verifiers")
    make_tiny_model(base / "model", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1)
    save_rows(verifiers_rows(single_turn_env()), base / "train.jsonl")
    return base


def test_rows_carry_the_environment_examples():
    rows = verifiers_rows(follow_up_env())
    assert [r["prompt"] for r in rows] == [[{"role": "user", "content": q}] for q in QUESTIONS]
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["5", "8", "8", "7"]
    assert all(VERIFIERS_INPUT in r["extra_info"] for r in rows)


def test_grpo_trains_two_steps_on_verifiers_environments(assets):
    out = run_distributed(fit_both, 1, str(assets), timeout=600)[0]
    for name, turns in (("single_turn_agent", (1.0, 1.0)), ("follow_up_agent", (1.5, 2.0))):
        result = out[name]
        assert result["checked"] == [8, 8], name
        assert len(result["metrics"]) == 2
        for step in result["metrics"]:  # an empty first reply (eos) ends a two-turn rollout early
            assert turns[0] <= step["agent/turns"] <= turns[1], (name, step)
            assert step["agent/env_errors"] == 0.0, (name, step)
            assert "actor/pg_loss" in step and "agent/env_reward" in step
    assert all(m["agent/tool_token_share"] > 0 for m in out["follow_up_agent"]["metrics"])
    failing = out["rewriting_agent"]  # every second turn is refused: first turns kept, counted, reward 0
    assert failing["checked"] == [8]
    step = failing["metrics"][0]
    assert step["agent/turns"] == 1.0 and step["agent/env_reward"] == 0.0, step
    assert step["agent/env_errors"] > 0 and len(failing["errors"]) == step["agent/env_errors"] * 8, step
    assert all("verifiers ended the rollout" in e for e in failing["errors"]), failing["errors"]


def rank(completions) -> list[float]:
    """A group reward function (verifiers tells them by their plural parameters)."""
    return [float(i) for i in range(len(completions))]


def test_unsupported_environments_are_refused_clearly():
    with pytest.raises(TypeError, match="give a verifiers environment"):
        VerifiersAgent(object())
    with pytest.raises(ValueError, match="scores whole groups"):
        VerifiersAgent(vf.SingleTurnEnv(dataset=_dataset(), rubric=vf.Rubric(funcs=[rank])))
    with pytest.raises(ValueError, match=r"has tools \(\['rank'\]\)"):
        VerifiersAgent(vf.ToolEnv(dataset=_dataset(), tools=[rank]))
    assert require_verifiers() is vf


def test_missing_verifiers_names_the_install_line(monkeypatch, tmp_path):
    import sys
    import types

    from verl_trainer.serving.agent_spec import resolve_agent

    monkeypatch.setitem(sys.modules, "verifiers", None)
    with pytest.raises(ImportError, match="verifiers==0.3.1"):
        require_verifiers()
    harness_only = types.ModuleType("verifiers")  # 0.4.0's package root: only verifiers.v1 below it
    harness_only.__version__ = "0.4.0"
    monkeypatch.setitem(sys.modules, "verifiers", harness_only)
    with pytest.raises(ImportError, match=r"verifiers 0.4.0 has no in-process.*verifiers==0.3.1"):
        require_verifiers()
    monkeypatch.setitem(sys.modules, "verifiers", None)
    agent_file = tmp_path / "my_env.py"  # the config's agent loads when the config is built
    agent_file.write_text("from verl_trainer.environments.verifiers import VerifiersAgent\n"
                          "agent = VerifiersAgent(lambda: None)\n")
    with pytest.raises((ImportError, ValueError), match="pip install 'verifiers==0.3.1'"):
        resolve_agent(f"{agent_file}:agent")
