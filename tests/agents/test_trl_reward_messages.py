"""TRL-style rewards in multi-turn runs receive message lists (assistant and tool turns apart), as TRL's
``GRPOTrainer(tools=...)`` passes them: ``[assistant(tool_calls), tool, assistant]``, so TRL's documented
``completion[-1]["content"]`` is the final answer. A real HF rollout of the tiny tool policy, scored the
way the RL loop scores it (``score_batch``)."""

from __future__ import annotations

import pytest

from tests.agents.common import tool_policy
from tests.agents.test_bounded_agents import generate
from verl_trainer.agents import MultiTurnConfig, calculator
from verl_trainer.rewards import score_batch

SEEN: list = []


def final_answer_is_right(completions, ground_truth, **kwargs):  # TRL's documented tool-reward habit
    SEEN.extend(completions)
    return [float(c[-1]["content"].strip() == gt) for c, gt in zip(completions, ground_truth)]


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> str:
    return tool_policy(tmp_path_factory.mktemp("tool_policy") / "model")


def test_a_trl_reward_gets_assistant_and_tool_turns_apart(policy):
    batch, _ = generate(policy, MultiTurnConfig(enable=True, tools=[calculator]))
    SEEN.clear()
    scores, _ = score_batch(batch, final_answer_is_right)
    assert [[m["role"] for m in c] for c in SEEN] == [["assistant", "tool", "assistant"]] * 2
    first = SEEN[0]
    assert first[0]["tool_calls"] == [{"type": "function", "function": {"name": "calculator",
                                                                         "arguments": {"expression": "2+3"}}}]
    assert first[1] == {"role": "tool", "name": "calculator", "content": "5"}
    assert scores.tolist() == [1.0, 1.0]  # the final turns answer 5 and 8


def test_single_turn_text_prompts_still_give_plain_strings(policy):
    from verl_trainer.data.prompts import PromptDataset, to_verl_row
    from verl_trainer.models.loading import load_tokenizer
    from verl_trainer.rollout import RolloutConfig, build_rollout

    rollout = build_rollout(RolloutConfig(device="cpu", max_new_tokens=8, do_sample=False), policy)
    batch = rollout.generate(PromptDataset([to_verl_row("2+3=", "5", "arithmetic")], load_tokenizer(policy)))
    SEEN.clear()
    score_batch(batch, lambda completions, **kw: SEEN.extend(completions) or [0.0] * len(completions))
    assert len(SEEN) == 1 and isinstance(SEEN[0], str)
