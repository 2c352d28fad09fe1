"""A tiny judge model trained in seconds to grade arithmetic answers in the ``Score: N`` form."""

from __future__ import annotations

from pathlib import Path

import torch

from verl_trainer.models.loading import load_causal_lm, load_tokenizer
from verl_trainer.models.tiny import make_tiny_model

RUBRIC = "Q: {question} A: {response} R: {reference}"
QUESTIONS = ("2+3", "4+4", "7+1", "5+2")


def answer(question: str) -> str:
    """The right answer of one of :data:`QUESTIONS`."""
    a, b = question.split("+")
    return str(int(a) + int(b))


def cases() -> list[tuple[str, str, str, float]]:
    """``(question, response, reference, expected score)``: each question's right and a wrong answer."""
    out = []
    for q in QUESTIONS:
        out.append((q, answer(q), answer(q), 1.0))
        out.append((q, str(int(answer(q)) + 1), answer(q), 0.0))
    return out


def train_judge(path: str | Path, steps: int = 200) -> str:
    """A 1-layer qwen2 at ``path`` that answers ``Score: 10`` / ``Score: 0`` on :func:`cases` (greedy)."""
    make_tiny_model(path, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                    seed=5)
    tokenizer, model = load_tokenizer(path), load_causal_lm(path)
    rows = []
    for q, response, reference, score in cases():
        text = RUBRIC.format(question=q, response=response, reference=reference)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                               add_generation_prompt=True)
        p = tokenizer.encode(prompt, add_special_tokens=False)
        verdict = f"Score: {10 if score else 0}"
        r = tokenizer.encode(verdict, add_special_tokens=False) + [tokenizer.eos_token_id]
        rows.append((p, r))
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        labels[i, len(p): len(p) + len(r)] = torch.tensor(r)
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
