"""Trained ids are the served ids, byte for byte, across turns, with a lossy tokenizer (real HTTP, model)."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.serving.common import round_trip_differs, tiny_rollout
from verl_trainer.agents.template import ObservationEncoder
from verl_trainer.data import schema
from verl_trainer.rollout import AGENT_INFO
from verl_trainer.serving import AgentContext, ServedAgentLoop

QUESTIONS = ("What is 2+3?", "Name A CAT.", "Say HELLO!")
FOLLOW_UP = {"role": "user", "content": "Try AGAIN."}


def _messages(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    return tiny_rollout(tmp_path_factory.mktemp("served") / "policy")


def _items(tokenizer, questions=QUESTIONS):
    items = []
    for i, q in enumerate(questions):
        text = tokenizer.apply_chat_template(_messages(q), tokenize=False, add_generation_prompt=True)
        items.append({"input_ids": tokenizer.encode(text, add_special_tokens=False), "index": i,
                      "ground_truth": q, "data_source": "served", "extra_info": {"question": q}})
    return items


def test_chat_trajectories_train_the_served_ids(rollout):
    served: dict[str, list[dict]] = {}

    def agent(context: AgentContext) -> float:
        question = context.row["extra_info"]["question"]
        messages = _messages(question)
        with httpx.Client(base_url=context.base_url, timeout=60) as client:
            first = client.post("/chat/completions", json={"model": context.model, "messages": messages,
                                                           "trajectory_id": context.trajectory_id,
                                                           "max_tokens": 12})
            first.raise_for_status()
            reply = first.json()["choices"][0]
            messages = [*messages, {"role": "assistant", "content": reply["message"]["content"].strip()},
                        FOLLOW_UP]
            second = client.post("/chat/completions", json={"messages": messages, "max_tokens": 12},
                                 headers=context.headers)
            second.raise_for_status()
        served[context.trajectory_id] = [first.json(), second.json()]
        return 0.5

    loop = ServedAgentLoop(agent, rollout.tokenizer, rollout.eos_token_ids)
    rollout.agent_loop = loop
    try:
        batch = rollout.generate(_items(rollout.tokenizer), step=0, n=2, max_new_tokens=64)
    finally:
        rollout.agent_loop = None
        loop.close()
    assert not loop.last_errors
    assert len(served) == 6
    encoder = ObservationEncoder(rollout.tokenizer, rollout.eos_token_ids)
    observation = encoder.encode([FOLLOW_UP])
    by_prompt = {}
    for turns in served.values():
        by_prompt.setdefault(tuple(turns[0]["prompt_token_ids"]), []).append(turns)
    lossy = 0
    for row in range(len(batch)):
        p, r = int(batch[schema.PROMPT_LEN][row]), int(batch[schema.RESPONSE_LEN][row])
        ids = batch[schema.INPUT_IDS][row]
        prompt, response = ids[:p].tolist(), ids[p: p + r].tolist()
        mask = batch[schema.LOSS_MASK][row, p: p + r].tolist()
        log_probs = batch[schema.ROLLOUT_LOG_PROBS][row, p: p + r]
        candidates = by_prompt[tuple(prompt)]
        first, second = next(t for t in candidates
                             if t[0]["choices"][0]["token_ids"] + observation
                             + t[1]["choices"][0]["token_ids"] == response)
        one, two = first["choices"][0]["token_ids"], second["choices"][0]["token_ids"]
        assert second["prompt_token_ids"] == prompt + one + observation  # the context, never re-tokenised
        assert mask == [1.0] * len(one) + [0.0] * len(observation) + [1.0] * len(two)
        served_lps = [c["logprob"] for t in (first, second) for c in t["choices"][0]["logprobs"]["content"]]
        expected = torch.tensor(served_lps[: len(one)] + [0.0] * len(observation) + served_lps[len(one):])
        assert torch.equal(log_probs, expected.to(torch.float32))
        assert batch[AGENT_INFO][row]["reward"] == 0.5 and batch[AGENT_INFO][row]["turns"] == 2
        lossy += round_trip_differs(rollout.tokenizer, one) + round_trip_differs(rollout.tokenizer, two)
    assert lossy > 0, "no sampled turn has a lossy round trip: the test would not catch re-tokenisation"


def test_token_prompts_and_errors_of_agents(rollout):
    """Token-id turns extend the trajectory; a raising agent keeps its recorded turns and counts an error."""

    def agent(context: AgentContext) -> float:
        with httpx.Client(base_url=context.base_url, timeout=60) as client:
            body = {"prompt": context.prompt_ids, "trajectory_id": context.trajectory_id, "max_tokens": 5}
            first = client.post("/completions", json=body).json()["choices"][0]
            follow = context.prompt_ids + first["token_ids"] + [5, 6]
            second = client.post("/completions", json={**body, "prompt": follow}).json()["choices"][0]
            if context.row["extra_info"]["question"] == QUESTIONS[0]:
                raise RuntimeError("the environment broke")
            assert second["finish_reason"] in ("stop", "length")
            # 5 + 2 + 5 of the 12 tokens are used: an observation of 1 id leaves no room for an answer
            used = context.prompt_ids + first["token_ids"] + [5, 6] + second["token_ids"]
            if len(used) - len(context.prompt_ids) == 12:
                third = client.post("/completions", json={**body, "prompt": used + [7]}).json()["choices"][0]
                assert third["token_ids"] == [] and third["finish_reason"] == "length"
        return 1.0

    loop = ServedAgentLoop(agent, rollout.tokenizer, rollout.eos_token_ids)
    rollout.agent_loop = loop
    try:
        batch = rollout.generate(_items(rollout.tokenizer), step=1, max_new_tokens=12)
        server = loop.server
        again = rollout.generate(_items(rollout.tokenizer), step=1, max_new_tokens=12)
        assert loop.server is server, "the server lives as long as the rollout, not one generate call"
    finally:
        rollout.agent_loop = None
        loop.close()
    assert torch.equal(again[schema.INPUT_IDS], batch[schema.INPUT_IDS])  # seeded: the same trajectories
    infos = list(batch[AGENT_INFO])
    assert [i["env_errors"] for i in infos] == [1, 0, 0]
    assert [i["reward"] for i in infos] == [0.0, 1.0, 1.0]
    assert "the environment broke" in loop.last_errors[0]
    for row in range(len(batch)):
        p, r = int(batch[schema.PROMPT_LEN][row]), int(batch[schema.RESPONSE_LEN][row])
        mask = batch[schema.LOSS_MASK][row, p: p + r].tolist()
        assert mask.count(0.0) == 2 and r <= 12  # the two observation ids [5, 6], within the budget


def test_the_server_stops_with_its_loop(rollout):
    import gc

    loop = ServedAgentLoop(lambda context: 1.0, rollout.tokenizer, rollout.eos_token_ids)
    rollout.agent_loop = loop
    rollout.generate(_items(rollout.tokenizer)[:1], step=2)
    url = loop.server.url
    assert httpx.get(url + "/models").status_code == 200
    rollout.agent_loop = None
    del loop
    gc.collect()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/models", timeout=5)
