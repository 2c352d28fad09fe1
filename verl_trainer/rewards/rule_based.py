r"""Built-in rule-based rewards: exact numeric answer, answer format, and their combination.

Registered names (see :mod:`verl_trainer.rewards.registry` for the signature):

* ``"math_exact"``: 1 when the final answer of the response equals the ground truth numerically, else 0.
* ``"format"``: 1 when the response *is* an answer in an accepted format, else 0.
* ``"math"`` (also ``"default"``): 1 when correct; :data:`FORMAT_SCORE` when wrong but well formatted;
  0 otherwise. The default of the recipes.

The **final answer** of a text (:func:`extract_answer`) is the number after the last ``####`` (GSM8K
style), else the content of the last ``\boxed{...}``, else the last number in the text. Accepted
**formats** (:func:`is_well_formatted`): the whole response is one number (the synthetic arithmetic
task: ``"7"``), or it ends with ``#### <number>`` or ``\boxed{<number>}``.
"""

from __future__ import annotations

import math
import re
from typing import Any

from verl_trainer.rewards.registry import register_reward

FORMAT_SCORE = 0.1
"""Score of a well-formatted but wrong answer under ``"math"``."""

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_HASH_RE = re.compile(r"####\s*(.*)", re.DOTALL)
_BOXED = "\\boxed"
_FORMATS = (
    re.compile(rf"\s*(?:{_NUMBER})\s*"),
    re.compile(rf".*####\s*\$?(?:{_NUMBER})\s*", re.DOTALL),
    re.compile(rf".*\\boxed\{{\s*(?:{_NUMBER})\s*\}}\s*\.?\s*", re.DOTALL),
)


def parse_number(text: Any) -> float | None:
    """A number from a short answer string (``"1,234"``, ``"$5"``, ``"-3.0."``, ``7``); ``None`` if none."""
    if isinstance(text, bool):
        return None
    if isinstance(text, (int, float)):
        return float(text)
    if not isinstance(text, str):
        return None
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".").strip()
    try:
        value = float(cleaned)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def last_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` of ``text``, nested braces kept (``\frac{1}{2}``).

    Returns:
        The content, stripped, or ``None`` without a complete ``\boxed{}``.
    """
    start = text.rfind(_BOXED + "{")
    while start != -1:
        depth, i = 0, start + len(_BOXED)
        for i in range(start + len(_BOXED), len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start + len(_BOXED) + 1: i].strip()
        start = text.rfind(_BOXED + "{", 0, start)  # unclosed: try the one before
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a response or a GSM8K-style solution (see the module docstring).

    Args:
        text: The response text.

    Returns:
        The answer string (commas kept), or ``None`` when the text holds no answer.

    """
    hashes = text.rsplit("####", 1)
    if len(hashes) == 2:
        match = _NUMBER_RE.search(hashes[1])
        if match:
            return match.group(0)
        tail = hashes[1].strip()
        return tail.splitlines()[0].strip() if tail else None
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1] if numbers else None


def _ground_truth_answer(ground_truth: Any) -> Any:
    if isinstance(ground_truth, str) and "####" in ground_truth:
        return extract_answer(ground_truth)
    return ground_truth


def answers_match(answer: str | None, ground_truth: Any, rel_tol: float = 1e-6) -> bool:
    """Numeric equality when both parse as numbers, else exact match of the stripped strings."""
    if answer is None or ground_truth is None:
        return False
    truth = _ground_truth_answer(ground_truth)
    a, b = parse_number(answer), parse_number(truth)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=rel_tol, abs_tol=rel_tol)
    return str(answer).strip() == str(truth).strip()


def is_well_formatted(text: str) -> bool:
    """True when the response is an answer in an accepted format (see the module docstring)."""
    return any(pattern.fullmatch(text) for pattern in _FORMATS)


def _require_truth(ground_truth: Any, name: str) -> None:
    if ground_truth is None:
        raise ValueError(
            f"reward {name!r} compares the answer with the ground truth, and this prompt has none: give the "
            "prompt rows a ground truth (verl's reward_model.ground_truth, a ground_truth column, or TRL's "
            "solution), or use a reward that needs none (algorithm.reward.name=format, or a TRL-style "
            "function)"
        )


@register_reward("math_exact")
def math_exact(data_source: str, solution_str: str, ground_truth: Any,
               extra_info: dict | None = None) -> dict[str, float]:
    """1 when the final answer equals the ground truth (numerically), else 0.

    Returns:
        ``{"score": s, "acc": s}``.

    """
    _require_truth(ground_truth, "math_exact")
    correct = float(answers_match(extract_answer(solution_str), ground_truth))
    return {"score": correct, "acc": correct}


@register_reward("format")
def format_reward(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: dict | None = None) -> dict[str, float]:
    """1 when the response is in an accepted answer format, else 0.

    Returns:
        ``{"score": f, "format": f}``.

    """
    ok = float(is_well_formatted(solution_str))
    return {"score": ok, "format": ok}


@register_reward("math", "default")
def math_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                format_score: float = FORMAT_SCORE) -> dict[str, float]:
    """Correct answer 1; wrong but well formatted ``format_score``; otherwise 0.

    Returns:
        ``{"score": ..., "acc": 0 or 1, "format": 0 or 1}``.

    """
    _require_truth(ground_truth, "math")
    correct = float(answers_match(extract_answer(solution_str), ground_truth))
    formatted = float(is_well_formatted(solution_str))
    score = 1.0 if correct else format_score * formatted
    return {"score": score, "acc": correct, "format": formatted}


@register_reward("none")
def no_reward(data_source: str, solution_str: str, ground_truth: Any,
              extra_info: dict | None = None) -> float:
    """0 for every response: the rule part of a run whose reward is a reward model alone."""
    return 0.0
