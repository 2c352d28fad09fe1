"""Hostile model outputs: the tool-call parser never raises (what it cannot read is a ``MalformedToolCall``)
and runs in linear time, and ``AgentLoop.run`` never stops on them.

The loop test scripts the backend's sampled turns (a real model cannot be made to write these texts): the
loop, the real tools, the tokenizer and the chat template run as in a rollout.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_trainer.agents import MalformedToolCall, MultiTurnConfig, ToolCall, calculator, parse_hermes
from verl_trainer.models.loading import load_tokenizer
from verl_trainer.models.tiny import make_tiny_model
from verl_trainer.rollout import RolloutConfig
from verl_trainer.rollout.agent_loop import MAX_CALLS_PER_TURN, AgentLoop

ASCII = st.characters(min_codepoint=32, max_codepoint=126)
FRAGMENTS = st.one_of(
    st.text(ASCII, max_size=40),
    st.sampled_from(["<tool_call>", "</tool_call>", '{"name": "calculator", "arguments": ', '{"name": ',
                     '"arguments": "{\\"expression\\": \\"1+1\\"}"}', "}", "]", ",", "NaN", "-Infinity",
                     "1e999", '"\\ud800"', '"\\udfff\\ud800x"', '{"name": "\\ud83d"}', '"\\u0000"', "null"]),
    st.integers(1, 30_000).map(lambda n: "[" * n),  # nesting past the recursion limit
    st.integers(1, 3_000).map(lambda n: '{"a":' * n),
    st.integers(4_000, 20_000).map(lambda n: "9" * n),  # past int's default 4300-digit limit
)
HOSTILE = st.lists(FRAGMENTS, max_size=8).map("".join)
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=300)  # lone surrogates included


def assert_parsed(text: str) -> list:
    calls = parse_hermes(text)
    assert isinstance(calls, list)
    assert all(isinstance(c, (ToolCall, MalformedToolCall)) for c in calls)
    return calls


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(HOSTILE, ANY_TEXT, HOSTILE.map(lambda t: f"<tool_call>{t}</tool_call>"),
                 st.tuples(ANY_TEXT, HOSTILE).map(lambda p: f"{p[0]}<tool_call>{p[1]}</tool_call>{p[0]}")))
def test_the_parser_never_raises_on_hostile_text(text):
    assert_parsed(text)


def test_the_known_hostile_shapes_are_malformed_calls_and_parse_in_linear_time():
    cases = {
        "[" * 100_000: "nested too deeply",
        '{"name": "calculator", "arguments": ' + "9" * 10_000 + "}": "unreadable",
        '{"name": "calculator", "arguments": "' + "[" * 100_000 + '"}': '"arguments" is a JSON object',
        "{not json": "not valid JSON",
    }
    for body, error in cases.items():
        (call,) = assert_parsed(f"<tool_call>{body}</tool_call>")
        assert isinstance(call, MalformedToolCall) and error in call.error
    (call,) = assert_parsed('<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>')
    assert call == ToolCall("\ud800", {})  # a lone surrogate name is read; the observation replaces it
    begin = time.monotonic()
    assert assert_parsed("<tool_call>" * 200_000) == []  # quadratic with a lazy regex (minutes)
    assert len(assert_parsed("<tool_call>{}</tool_call>" * 50_000)) == 50_000
    assert time.monotonic() - begin < 20


@pytest.fixture(scope="module")
def loop(tmp_path_factory) -> AgentLoop:
    path = make_tiny_model(tmp_path_factory.mktemp("hostile") / "model", arch="qwen2", hidden_size=32,
                           num_hidden_layers=1)
    tokenizer = load_tokenizer(path)
    return AgentLoop(MultiTurnConfig(enable=True, tools=[calculator], max_turns=3, tool_timeout_s=5),
                     tokenizer, [tokenizer.eos_token_id])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(HOSTILE, HOSTILE.map(lambda t: f"<tool_call>{t}</tool_call>"),
                          st.just('<tool_call>{"name": "calculator", "arguments": {}}</tool_call>' * 100)),
                min_size=1, max_size=3))
def test_the_agent_loop_never_stops_on_hostile_turns(loop, texts):
    tokenizer = loop.tokenizer
    eos = tokenizer.eos_token_id
    hostile = [tokenizer.encode(t, add_special_tokens=False) + [eos] for t in texts]
    seen = []

    def generate(prompts, config, seeds):  # turn 0: the hostile texts; later turns: an empty answer
        out = hostile if not seen else [[eos]] * len(prompts)
        seen.append(len(prompts))
        return out, [[0.0] * len(o) for o in out]

    prompt = tokenizer.encode("user: hi\n", add_special_tokens=False)
    sampling = RolloutConfig(device="cpu", max_new_tokens=10**6)
    trajs = loop.run(generate, [prompt] * len(texts), [{}] * len(texts), sampling, list(range(len(texts))),
                     lambda seed, turn: seed + turn)
    assert len(trajs) == len(texts)
    for traj in trajs:
        assert traj.turns >= 1 and traj.tool_calls <= MAX_CALLS_PER_TURN + 1
        for message in traj.messages[1:]:
            message["content"].encode("utf-8")  # observations hold no lone surrogate
