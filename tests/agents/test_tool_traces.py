"""The demo's calculator tool-use traces: chat rows whose SFT loss covers exactly what the policy samples in a
multi-turn rollout (the call and its eos, the answer and its eos), never the tool's result."""

from __future__ import annotations

import json

import pytest

from verl_trainer.agents import ObservationEncoder, parse_hermes
from verl_trainer.data.sft import encode_chat_example
from verl_trainer.data.tasks import ArithmeticTaskConfig, write_arithmetic_task
from verl_trainer.models.tiny import build_tokenizer


def test_tool_traces_train_the_call_and_the_answer_as_the_rollout_samples_them(tmp_path):
    task = ArithmeticTaskConfig(num_train=8, num_val=2, min_operand=10, max_operand=99, operations=("*",),
                                chat=True, tool_traces=3)
    paths = write_arithmetic_task(tmp_path, task)
    rows = [json.loads(line) for line in paths["sft_tool_train"].read_text().splitlines()]
    train = [json.loads(line) for line in paths["train"].read_text().splitlines()]
    assert len(rows) == 3
    tokenizer = build_tokenizer()
    eos = tokenizer.eos_token_id
    for row, source in zip(rows, train):
        question, answer = source["extra_info"]["question"], source["reward_model"]["ground_truth"]
        user, call, tool, final = row["messages"]
        assert (user["content"], tool["content"]) == (question, answer)
        (parsed,) = parse_hermes(call["content"])
        assert parsed.name == "calculator" and parsed.arguments == {"expression": question[:-1]}
        ids, mask = encode_chat_example(tokenizer, row["messages"])
        trained = [i for i, m in zip(ids, mask) if m]
        call_ids = tokenizer.encode(call["content"].removesuffix("<eos>"), add_special_tokens=False) + [eos]
        answer_ids = tokenizer.encode(answer, add_special_tokens=False) + [eos]
        newline = tokenizer.encode("\n", add_special_tokens=False)
        assert trained == call_ids + newline + answer_ids + newline  # the template ends a message with "\n"
        # after the call's eos, the rollout appends the tool's result as the same tokens, untrained
        observation = ObservationEncoder(tokenizer, [eos]).encode([{"role": "tool", "content": answer}])
        start = ids.index(eos) + 1
        assert ids[start: start + len(observation)] == observation
        assert not any(mask[start + 1: start + len(observation)])


def test_more_tool_traces_than_training_rows_is_refused():
    with pytest.raises(ValueError, match=r"tool_traces=9 must be in \[0, num_train=8\]"):
        ArithmeticTaskConfig(num_train=8, tool_traces=9)
