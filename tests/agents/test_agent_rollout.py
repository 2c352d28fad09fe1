"""Multi-turn rollouts on the HF rollout with a real tiny model: the trained ids are the sampled ids, the
loss mask is 1 on model tokens and 0 on tool / environment tokens, and failing or slow tools become error
observations."""

from __future__ import annotations

import time

import pytest
import torch

from tests.agents.common import (
    QUESTIONS,
    Again,
    call_text,
    check_again_trajectories,
    prompts,
    record_turns,
    response,
    tool_policy,
)
from tests.trainer.common import tiny_model
from verl_trainer.agents import MultiTurnConfig, ObservationEncoder, Tool, calculator
from verl_trainer.data import schema
from verl_trainer.models.loading import load_tokenizer
from verl_trainer.rollout import AGENT_INFO, RESPONSE_TEXT, RolloutConfig, build_rollout


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> str:
    return tool_policy(tmp_path_factory.mktemp("tool_policy") / "model")


@pytest.fixture(scope="module")
def random_model(tmp_path_factory) -> str:
    return tiny_model(tmp_path_factory.mktemp("random_policy") / "model")


def rollout_of(model: str, multi_turn: MultiTurnConfig, **sampling):
    config = RolloutConfig(device="cpu", max_new_tokens=sampling.pop("max_new_tokens", 160),
                           multi_turn=multi_turn, **sampling)
    return build_rollout(config, model)


def test_the_policy_calls_the_calculator_and_tool_tokens_are_masked(policy):
    tokenizer = load_tokenizer(policy)
    rollout = rollout_of(policy, MultiTurnConfig(enable=True, tools=[calculator]), do_sample=False)
    batch = rollout.generate(prompts(policy))
    encoder = ObservationEncoder(tokenizer, [tokenizer.eos_token_id])
    for row, question in enumerate(QUESTIONS):
        ids, mask, log_probs = response(batch, row)
        answer = str(eval(question[:-1]))
        observation = encoder.encode([{"role": "tool", "content": answer}])
        eos = [tokenizer.eos_token_id]
        first = tokenizer.encode(call_text(question[:-1]), add_special_tokens=False) + eos
        assert ids[: len(first)] == first, tokenizer.decode(ids)  # the model made the call
        assert ids[len(first): len(first) + len(observation)] == observation  # the calculator's answer
        rest = len(ids) - len(first) - len(observation)
        assert mask == [1.0] * len(first) + [0.0] * len(observation) + [1.0] * rest
        assert batch[schema.RESPONSE_MASK][row].tolist() == batch[schema.LOSS_MASK][row].tolist()
        assert all(lp == 0.0 for lp, m in zip(log_probs, mask) if m == 0)
        info = batch[AGENT_INFO][row]
        assert info["tool_calls"] == 1 and info["per_tool"] == {"calculator": 1} and info["tool_errors"] == 0
        assert info["turns"] == 2 and info["observation_tokens"] == len(observation)
        assert f"tool: {answer}" in batch[RESPONSE_TEXT][row]


def test_trained_ids_are_the_sampled_ids_even_where_decode_then_encode_differs(random_model):
    tokenizer = load_tokenizer(random_model)
    rollout = rollout_of(random_model, MultiTurnConfig(enable=True, environment=Again, max_turns=3), n=2,
                         temperature=1.5, max_new_tokens=120)
    calls = record_turns(rollout)
    batch = rollout.generate(prompts(random_model))
    assert len(calls) >= 2  # several turns
    check_again_trajectories(batch, calls, tokenizer, rollout.eos_token_ids)


def test_a_trajectory_without_tool_calls_is_the_single_turn_response(random_model):
    items = prompts(random_model)
    single = rollout_of(random_model, MultiTurnConfig(), n=2, max_new_tokens=24).generate(items, step=5)
    multi = rollout_of(random_model, MultiTurnConfig(enable=True, tools=[calculator]), n=2,
                       max_new_tokens=24).generate(items, step=5)
    assert all(i["tool_calls"] == 0 for i in multi[AGENT_INFO])
    for key in (schema.INPUT_IDS, schema.LOSS_MASK, schema.RESPONSE_MASK):
        assert torch.equal(single[key], multi[key]), key
    torch.testing.assert_close(single[schema.ROLLOUT_LOG_PROBS], multi[schema.ROLLOUT_LOG_PROBS])


class BrokenCalculator(Tool):
    """A calculator that fails (``mode="raise"``) or hangs (``mode="sleep"``)."""

    name = "calculator"
    mode = "raise"

    def schema(self):
        return calculator_schema()

    def execute(self, instance_id, arguments):
        if self.mode == "sleep":
            time.sleep(3)
            return "late"
        raise RuntimeError("the calculator is broken")


class SlowCalculator(BrokenCalculator):
    mode = "sleep"


def calculator_schema():
    from verl_trainer.agents import as_tool

    return as_tool(calculator).schema()


@pytest.mark.slow  # two more rollouts of 200 tokens with the warm-started policy
@pytest.mark.parametrize("tool, counter, text", [
    (BrokenCalculator, "tool_errors", "Error: calculator failed: RuntimeError: the calculator is broken"),
    (SlowCalculator, "tool_timeouts", "Error: the tool call ran past 0.5 s and was abandoned"),
])
def test_a_failing_or_slow_tool_is_an_error_observation_not_a_crash(policy, tool, counter, text):
    rollout = rollout_of(policy, MultiTurnConfig(enable=True, tools=[tool], tool_timeout_s=0.5, max_turns=2),
                         do_sample=False, max_new_tokens=200)
    batch = rollout.generate(prompts(policy, QUESTIONS[:2]))
    for row in range(2):
        info = batch[AGENT_INFO][row]
        assert info[counter] == 1 and info["tool_calls"] == 1
        tool_message = next(m for m in info["messages"] if m["role"] == "tool")
        assert tool_message["content"] == text[:256]
        ids, mask, _ = response(batch, row)
        assert 0.0 in mask and mask[-1] == 1.0  # the model answered the error observation
