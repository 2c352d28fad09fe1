"""Agents that talk to the policy only through the token server (named in ``multi_turn.agent``).

Each keeps what the server returned per trajectory in :data:`SERVED`, so a test compares the trained ids
with the served ones.
"""

from __future__ import annotations

import httpx

from verl_trainer.serving import AgentContext

SERVED: dict[str, list[dict]] = {}
"""Per trajectory id, the server's answers in turn order."""
FOLLOW_UP = "Check it."
MAX_TOKENS = 12
"""Tokens per turn: two turns and the follow-up fit the tests' ``max_new_tokens=64``."""


def _digits(text: str) -> float:
    return float(any(ch.isdigit() for ch in text))


def single_turn_agent(context: AgentContext) -> float:
    """One completion of the prompt's token ids; reward 1 when the answer holds a digit."""
    with httpx.Client(base_url=context.base_url, timeout=120) as client:
        answer = client.post("/completions", json={"prompt": context.prompt_ids, "max_tokens": MAX_TOKENS,
                                                   "trajectory_id": context.trajectory_id})
        answer.raise_for_status()
    SERVED[context.trajectory_id] = [answer.json()]
    return _digits(answer.json()["choices"][0]["text"])


def chat_agent(context: AgentContext) -> float:
    """Two chat turns (the question, then a follow-up); reward: the share of replies holding a digit."""
    messages = [{"role": "user", "content": context.row["extra_info"]["question"]}]
    answers = []
    with httpx.Client(base_url=context.base_url, timeout=120, headers=context.headers) as client:
        for _ in range(2):
            answer = client.post("/chat/completions", json={"messages": messages, "max_tokens": MAX_TOKENS})
            answer.raise_for_status()
            answers.append(answer.json())
            reply = answer.json()["choices"][0]["message"]["content"]
            messages = [*messages, {"role": "assistant", "content": reply},
                        {"role": "user", "content": FOLLOW_UP}]
    SERVED[context.trajectory_id] = answers
    return sum(_digits(a["choices"][0]["message"]["content"]) for a in answers) / 2
