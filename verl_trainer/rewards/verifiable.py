r"""Verifiable rewards dispatched by data source: verl's ``default_compute_score``.

:func:`default_compute_score` (registered as ``"default_compute_score"``, also ``"verifiable"``) scores one
response the way verl's does, by its ``data_source``:

* **GSM8K** (``openai/gsm8k``, ``gsm8k``): the number after the response's last ``####`` equals the ground
  truth (a ``####`` solution or a number); commas and ``$`` ignored. No ``####``: 0.
* **MATH-style** (``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``, ``HuggingFaceH4/MATH-500``,
  ``math``, ``math_dapo``, ``aime2024``, ``aime2025``): the response's final answer (its last
  ``\boxed{}``) is equivalent to the ground truth by the ``math-verify`` package (LaTeX parsed to sympy:
  ``\frac{1}{2}`` = ``0.5``, ``\sqrt{2}/2`` = ``\frac{\sqrt{2}}{2}``, sets, intervals, ...).
* **arithmetic** (this project's task, ``verl_trainer.data.tasks``): the ``math`` rule reward (1 correct,
  0.1 well-formatted but wrong, else 0).
* **code** (``codecontests``, ``apps``, ``codeforces``, ``taco``, ``code``): the fraction of test cases the
  response's program passes in the sandbox (:mod:`verl_trainer.rewards.code`; verl's test-case layout in
  ``extra_info["test_cases"]`` or the ground truth). Each test runs under the sandbox's own limits, so
  these calls do not go through the worker pool.

Each returns ``{"score", "acc"}`` (``acc``: 1 when correct). An unknown data source is a ``ValueError``
listing the known ones; :func:`check_data_sources` raises it before any model loads.

**Timeouts.** Every call runs in a worker process of a :class:`~verl_trainer.utils.timeout_pool.TimeoutPool`
(:func:`score_pool`; ``num_workers`` and ``timeout_s`` set by :func:`configure_score_pool`), so a
pathological expression cannot stall a step: past ``timeout_s`` (default 10 s) the worker is killed and
the call raises :class:`RewardTimeoutError` naming the data source and the response.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Iterable
from typing import Any

from verl_trainer.rewards.code import CODE_DATA_SOURCES, code_score
from verl_trainer.rewards.registry import register_reward
from verl_trainer.rewards.rule_based import (
    answers_match,
    extract_answer,
    last_boxed,
    math_reward,
    parse_number,
)
from verl_trainer.rewards.sandbox import check_sandbox
from verl_trainer.utils.timeout_pool import CallFailedError, CallTimeoutError, TimeoutPool

__all__ = [
    "KNOWN_DATA_SOURCES",
    "RewardTimeoutError",
    "check_data_sources",
    "configure_score_pool",
    "default_compute_score",
    "gsm8k_score",
    "math_verify_score",
    "score_pool",
]


class RewardTimeoutError(TimeoutError):
    """A reward call ran past its time limit (the message names the data source and the response)."""


def gsm8k_score(solution_str: str, ground_truth: Any) -> dict[str, float]:
    """GSM8K: the number after the last ``####`` of the response equals the ground truth."""
    if "####" not in solution_str:
        return {"score": 0.0, "acc": 0.0}
    ok = float(answers_match(extract_answer(solution_str), ground_truth))
    return {"score": ok, "acc": ok}


def math_verify_score(solution_str: str, ground_truth: Any) -> dict[str, float]:
    r"""MATH: the response's last ``\boxed{}`` (else its whole text) is equivalent to the ground truth.

    Equivalence is ``math_verify.verify`` on both parsed (``math_verify.parse``); a plain number on both
    sides is compared numerically without parsing.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # its own signal-based limits are off: the pool's limit stops the whole call, and it is counted
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    truth = str(ground_truth)
    boxed = last_boxed(solution_str)
    a, b = parse_number(boxed), parse_number(last_boxed(truth) or truth)
    if a is not None and b is not None:
        ok = float(answers_match(boxed, b))
        return {"score": ok, "acc": ok}
    gold = parse(truth if "\\boxed" in truth else f"\\boxed{{{truth}}}",
                 extraction_config=[LatexExtractionConfig()], parsing_timeout=None)
    pred = parse(f"\\boxed{{{boxed}}}" if boxed is not None else solution_str,
                 extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()], parsing_timeout=None)
    ok = float(bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=None))
    return {"score": ok, "acc": ok}


def _arithmetic_score(solution_str: str, ground_truth: Any) -> dict[str, float]:
    return math_reward("arithmetic", solution_str, ground_truth)


_GSM8K = ("openai/gsm8k", "gsm8k")
_MATH = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math",
         "math_dapo", "aime2024", "aime2025")
_SCORERS: dict[str, Callable[[str, Any], dict[str, float]]] = {
    **dict.fromkeys(_GSM8K, gsm8k_score),
    **dict.fromkeys(_MATH, math_verify_score),
    "arithmetic": _arithmetic_score,
    **dict.fromkeys(CODE_DATA_SOURCES, None),  # type: ignore[dict-item]  (scored in the caller's process)
}
KNOWN_DATA_SOURCES: tuple[str, ...] = tuple(_SCORERS)
"""The data sources :func:`default_compute_score` knows."""


def _has_math_verify() -> bool:
    return importlib.util.find_spec("math_verify") is not None


def check_data_sources(sources: Iterable[str]) -> None:
    """Raise for a data source :func:`default_compute_score` does not know or cannot score.

    Raises:
        ValueError: An unknown data source (the known ones listed).
        ImportError: A MATH-style source without the ``math-verify`` package (the extra to install named).
        SandboxUnavailableError: A code source, and no isolation tool can run programs here.
    """
    unknown = sorted({str(s) for s in sources} - set(_SCORERS))
    if unknown:
        raise ValueError(
            f"default_compute_score has no scorer for the data source(s) {unknown}; it knows "
            f"{list(KNOWN_DATA_SOURCES)}. Rename the data_source column to one of them, or give your own "
            "reward function (algorithm.reward.name=my_reward.py:compute_score)"
        )
    if any(str(s) in CODE_DATA_SOURCES for s in sources):
        check_sandbox()
    if any(str(s) in _MATH for s in sources) and not _has_math_verify():
        raise ImportError("default_compute_score scores MATH-style data sources with the math-verify "
                          "package, which is not installed: pip install 'verl-trainer[rewards]' (or "
                          "math-verify)")


def _score(data_source: str, solution_str: str, ground_truth: Any) -> dict[str, float]:
    return _SCORERS[data_source](solution_str, ground_truth)


_POOL: TimeoutPool | None = None
_POOL_SETTINGS = {"num_workers": 2, "timeout_s": 10.0}


def configure_score_pool(num_workers: int = 2, timeout_s: float = 10.0) -> None:
    """Set the workers and the per-call time limit of :func:`default_compute_score`.

    A new worker count restarts the pool; a new limit applies from the next call.
    """
    global _POOL
    TimeoutPool.check_settings(num_workers, timeout_s)
    if _POOL is not None and _POOL.num_workers != num_workers:
        _POOL.close()
        _POOL = None
    if _POOL is not None:
        _POOL.timeout_s = float(timeout_s)
    _POOL_SETTINGS.update(num_workers=num_workers, timeout_s=timeout_s)


def score_pool() -> TimeoutPool:
    """The worker pool every :func:`default_compute_score` call runs in (made on first use)."""
    global _POOL
    if _POOL is None:
        preload = [__name__, *(["math_verify"] if _has_math_verify() else [])]
        _POOL = TimeoutPool(preload=preload, **_POOL_SETTINGS)  # type: ignore[arg-type]
    return _POOL


@register_reward("default_compute_score", "verifiable")
def default_compute_score(data_source: str, solution_str: str, ground_truth: Any,
                          extra_info: dict | None = None) -> dict[str, float]:
    """Score one response by its data source (see the module docstring), in a worker under a time limit.

    Returns:
        ``{"score": s, "acc": 0 or 1}`` (code: also ``tests``).

    Raises:
        ValueError: An unknown data source (the known ones listed), or code test cases in no known layout.
        ImportError: A MATH-style source without the ``math-verify`` package.
        RewardTimeoutError: The scorer ran past the pool's ``timeout_s``.
        RuntimeError: The scorer raised (its traceback in the message).
    """
    check_data_sources([data_source])
    if data_source in CODE_DATA_SOURCES:
        return code_score(solution_str, ground_truth, extra_info)
    try:
        return score_pool().run(_score, data_source, solution_str, ground_truth)
    except CallTimeoutError:
        raise RewardTimeoutError(
            f"default_compute_score on data source {data_source!r} ran past {score_pool().timeout_s:g} s "
            f"for the response {solution_str[:200]!r} (ground truth {str(ground_truth)[:100]!r}); raise "
            "the limit with verl_trainer.rewards.configure_score_pool(timeout_s=...)"
        ) from None
    except CallFailedError as err:
        raise RuntimeError(f"default_compute_score on data source {data_source!r} failed for the response "
                           f"{solution_str[:200]!r}: {err}") from None


default_compute_score.check_data_sources = check_data_sources  # type: ignore[attr-defined]
"""``RewardFunctions.check_data_sources`` calls it with the data's sources before any model loads."""
