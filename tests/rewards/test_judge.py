"""LLM-as-judge rewards with tiny judges on CPU: a trained judge grades right, a random judge's malformed
answers and a late judge go through the reward failure policy, and bad judge configs fail when built."""

from __future__ import annotations

import threading

import pytest

from tests.serving.judge_model import RUBRIC, cases, train_judge
from verl_trainer.models.tiny import make_tiny_model
from verl_trainer.rewards import RewardFunctions
from verl_trainer.rewards.failures import RewardError
from verl_trainer.rewards.judge import JudgeConfig, JudgeParseError, LLMJudge, parse_score, parse_verdict
from verl_trainer.rollout.config import RolloutConfig
from verl_trainer.rollout.hf import HFRollout
from verl_trainer.serving import ServerConfig, TokenServer


def _batch():
    rows = cases()
    return ([r for _, r, _, _ in rows], [ref for _, _, ref, _ in rows], ["arith"] * len(rows),
            [{"question": q} for q, _, _, _ in rows], [s for *_, s in rows])


@pytest.fixture(scope="module")
def judge_path(tmp_path_factory):
    return train_judge(tmp_path_factory.mktemp("judge") / "model")


def test_a_trained_judge_grades_as_a_second_engine_and_behind_a_token_server(judge_path):
    texts, truths, sources, extras, expected = _batch()
    judge = LLMJudge(JudgeConfig(model_path=judge_path, rubric=RUBRIC, device="cpu"))
    try:
        scores, _ = RewardFunctions(judge, on_error="error")(texts, truths, sources, extras)
    finally:
        judge.close()
    assert scores.tolist() == expected
    engine = HFRollout(RolloutConfig(do_sample=False, max_new_tokens=12, device="cpu"), judge_path)
    with TokenServer(engine.generate_token_ids, engine.config, engine.tokenizer, engine.eos_token_ids,
                     ServerConfig(model_name="grader")) as server:
        served = LLMJudge(JudgeConfig(base_url=server.url, model="grader", rubric=RUBRIC))
        scores, _ = RewardFunctions(served, on_error="error")(texts, truths, sources, extras)
    assert scores.tolist() == expected


def test_malformed_and_late_judges_follow_the_failure_policy(tmp_path):
    texts, truths, sources, extras, _ = _batch()
    random_judge = make_tiny_model(tmp_path / "random", hidden_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    judge = LLMJudge(JudgeConfig(model_path=random_judge, rubric=RUBRIC, device="cpu", max_tokens=6))
    try:
        functions = RewardFunctions(judge, on_error="error")
        functions(texts[:2], truths[:2], sources[:2], extras[:2])
        with pytest.raises(RewardError, match="no 'Score: N'"):
            functions.raise_failures()
        zero = RewardFunctions(judge, on_error="zero")
        scores, _ = zero(texts[:2], truths[:2], sources[:2], extras[:2])
        assert scores.tolist() == [0.0, 0.0] and len(zero.failures) == 2
        assert all("JudgeParseError" in f.message and not f.timeout for f in zero.failures)
    finally:
        judge.close()

    gate = threading.Event()
    engine = HFRollout(RolloutConfig(do_sample=False, max_new_tokens=4, device="cpu"), random_judge)

    def stalled(prompts, config, seeds):
        gate.wait(20)
        return engine.generate_token_ids(prompts, config, seeds)

    with TokenServer(stalled, engine.config, engine.tokenizer, engine.eos_token_ids) as server:
        late = LLMJudge(JudgeConfig(base_url=server.url, rubric=RUBRIC, timeout_s=0.3))
        functions = RewardFunctions(late, on_error="drop")
        functions(texts[:1], truths[:1], sources[:1], extras[:1])
        gate.set()
    assert len(functions.failures) == 1 and functions.failures[0].timeout
    assert "timeout_s=0.3" in functions.failures[0].message


@pytest.mark.parametrize(("text", "parser", "score"), [
    ("Score: 7", parse_score, 0.7), ("rating=10 ... Score: 2.5", parse_score, 0.25),
    ("I think yes. Final: no", parse_verdict, 0.0), ("Correct", parse_verdict, 1.0),
])
def test_parsers(text, parser, score):
    config = JudgeConfig(base_url="http://127.0.0.1:1/v1")
    assert parser(text, config) == pytest.approx(score)


@pytest.mark.parametrize(("text", "parser", "names"), [
    ("Score: 11", parse_score, "outside"), ("great answer", parse_score, "Score: N"),
    ("maybe", parse_verdict, "no verdict"),
])
def test_malformed_answers_are_named(text, parser, names):
    with pytest.raises(JudgeParseError, match=names):
        parser(text, JudgeConfig(base_url="http://127.0.0.1:1/v1"))


@pytest.mark.parametrize(("kwargs", "names"), [
    ({}, "exactly one of base_url"),
    ({"base_url": "http://x/v1", "model_path": "m"}, "exactly one of base_url"),
    ({"base_url": "http://x/v1", "rubric": "grade {question}"}, "no {response}"),
    ({"base_url": "http://x/v1", "rubric": "{response} {answer}"}, "answer"),
    ({"base_url": "http://x/v1", "parser": "stars"}, "stars"),
    ({"base_url": "http://x/v1", "min_score": 5, "max_score": 5}, "min_score"),
    ({"base_url": "http://x/v1", "timeout_s": 0}, "timeout_s"),
])
def test_config_errors(kwargs, names):
    with pytest.raises(ValueError, match=names):
        JudgeConfig(**kwargs)
