"""The demo's reward-model pairs on the arithmetic task: the right answer against many kinds of wrong one.

A reward model that only ever compared the answer with a near miss (``recipes/dpo.py``'s pairs) scores
strings it never saw at random, and an RL policy optimising it finds them (an empty response, ``"0000"``).
So each problem gives many pairs, the answer (chosen) against each of (rejected): every other number from 0
to ``max(19, answer + 3)`` (the task's sums and their near misses), the empty response, a run of zeros, the
answer with a stray digit before or after it, and the answer written twice (the random parts drawn per
problem from ``seed``).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["WRONG_KINDS", "reward_model_rows", "wrong_answer"]

WRONG_KINDS = ("empty", "zeros", "prefix", "suffix", "twice")
"""The malformed kinds of rejected response, written after the wrong numbers."""


def wrong_answer(answer: int, kind: str, rng: random.Random) -> str:
    """A response of ``kind`` (:data:`WRONG_KINDS`) that is not ``str(answer)``.

    Raises:
        ValueError: An unknown kind.
    """
    text = str(answer)
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

    Per problem: one pair per other number in ``[0, max(19, answer + 3)]``, then one per kind of
    :data:`WRONG_KINDS`.
    """
    rng = random.Random(seed)
    out = []
    for row in rows:
        answer = int(row["response"])
        wrong = [str(v) for v in range(max(19, answer + 3) + 1) if v != answer]
        wrong += [wrong_answer(answer, kind, rng) for kind in WRONG_KINDS]
        out += [{"prompt": row["prompt"], "chosen": str(answer), "rejected": w} for w in wrong]
    return out
