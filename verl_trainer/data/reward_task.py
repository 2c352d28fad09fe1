"""The demo's reward-model pairs on the arithmetic task: the right answer against many kinds of wrong one.

A reward model that only ever compared the answer with a near miss (``recipes/dpo.py``'s pairs) scores
strings it never saw at random, and an RL policy optimising it finds them (an empty response, ``"0000"``).
So each problem gives several pairs, the answer (chosen) against each of (rejected): a near miss (offset in
``[-3, 3]``), a random other number below 100, the empty response, a run of zeros, the answer with a stray
digit before or after it, and the answer written twice — drawn per problem from ``seed``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["WRONG_KINDS", "reward_model_rows", "wrong_answer"]

WRONG_KINDS = ("near", "random", "empty", "zeros", "prefix", "suffix", "twice")
"""The kinds of rejected response, in the order each problem's pairs are written."""


def wrong_answer(answer: int, kind: str, rng: random.Random) -> str:
    """A response of ``kind`` (:data:`WRONG_KINDS`) that is not ``str(answer)``.

    Raises:
        ValueError: An unknown kind.
    """
    text = str(answer)
    if kind == "near":
        return str(answer + rng.choice([-3, -2, -1, 1, 2, 3]))
    if kind == "random":
        return str(rng.choice([v for v in range(100) if v != answer]))
    if kind == "empty":
        return ""
    if kind == "zeros":
        return "0" * rng.randint(2, 4)
    if kind == "prefix":
        return str(rng.randint(0, 9)) + text
    if kind == "suffix":
        return text + str(rng.randint(0, 9))
    if kind == "twice":
        return text + text
    raise ValueError(f"kind={kind!r}; choose one of {', '.join(WRONG_KINDS)}")


def reward_model_rows(rows: Sequence[Mapping[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """``{"prompt", "chosen", "rejected"}`` pairs from the task's SFT rows (``prompt``, ``response``).

    One pair per problem and kind of :data:`WRONG_KINDS`.
    """
    rng = random.Random(seed)
    out = []
    for row in rows:
        answer = int(row["response"])
        for kind in WRONG_KINDS:
            out.append({"prompt": row["prompt"], "chosen": str(answer),
                        "rejected": wrong_answer(answer, kind, rng)})
    return out
