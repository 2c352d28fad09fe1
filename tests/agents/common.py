"""A tiny policy that has learned to call the calculator: built from a config and warm-started in seconds.

The character tokenizer's chat template renders ``role: content`` lines, ``tool`` messages included, so
the tool-use trace of ``"a+b="`` is::

    user: a+b=
    assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "a+b"}}</tool_call><eos>
    tool: <a+b>
    assistant: <a+b><eos>

:func:`tool_policy` trains a randomly initialised 2-layer model on a few such traces (the loss on the
assistant tokens only), so greedy decoding makes the tool call: the multi-turn tests then exercise real
tool calls sampled by a real model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from verl_trainer.agents import ObservationEncoder
from verl_trainer.models.loading import load_causal_lm, load_tokenizer
from verl_trainer.models.tiny import make_tiny_model

QUESTIONS = ("2+3=", "4+4=", "7+1=", "5+2=")


def call_text(expression: str) -> str:
    """The Hermes tool call of the calculator on ``expression``."""
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + \
        "</tool_call>"


def trace(tokenizer, question: str) -> tuple[list[int], list[int], list[int]]:
    """``(prompt ids, response ids, response loss mask)`` of the tool-use trace of ``question``."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                           add_generation_prompt=True)
    answer = str(eval(question[:-1]))  # noqa: S307 - the test's own fixed questions
    eos = [tokenizer.eos_token_id]
    first = tokenizer.encode(call_text(question[:-1]), add_special_tokens=False) + eos
    observation = ObservationEncoder(tokenizer, eos).encode([{"role": "tool", "content": answer}])
    second = tokenizer.encode(answer, add_special_tokens=False) + eos
    response = first + observation + second
    mask = [1] * len(first) + [0] * len(observation) + [1] * len(second)
    return tokenizer.encode(prompt, add_special_tokens=False), response, mask


def tool_policy(path: str | Path, steps: int = 150) -> str:
    """A 1-layer qwen2 (hidden 32) trained to call the calculator on :data:`QUESTIONS`, saved to ``path``."""
    make_tiny_model(path, arch="qwen2", hidden_size=32, num_hidden_layers=1, seed=3)
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path)
    rows = [trace(tokenizer, q) for q in QUESTIONS]
    width = max(len(p) + len(r) for p, r, _ in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (p, r, m) in enumerate(rows):
        seq = torch.tensor(p + r)
        ids[i, : len(seq)] = seq
        target = torch.tensor([t if k else -100 for t, k in zip(r, m)])
        labels[i, len(p): len(p) + len(r)] = target
    torch.manual_seed(0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
    model.save_pretrained(path)
    return str(path)
