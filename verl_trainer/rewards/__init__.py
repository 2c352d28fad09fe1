"""Rule-based rewards: a registry of verl-compatible reward functions, and batch scoring.

``default_compute_score`` scores by data source as verl's does (GSM8K, MATH through math-verify, the
arithmetic task; :mod:`verl_trainer.rewards.verifiable`). ``get_reward_fn("math")`` (or ``"math_exact"``,
``"format"``, ``"default_compute_score"``, ``"my_pkg.rewards:fn"``,
``"path/to/file.py:fn"``) returns a function with verl's ``compute_score`` signature;
``score_batch(batch, reward_fn)`` scores a rollout batch, writes ``token_level_scores`` and returns its
``BatchScores`` (scores, reward metrics, per-sample info; ``scores, metrics = score_batch(...)`` unpacks it);
``score_responses`` and ``place_scores`` are its two halves, for a caller that checks the scores between.
"""

from typing import Any

from verl_trainer.rewards import rule_based, verifiable, vision
from verl_trainer.rewards.registry import (
    REWARD_REGISTRY,
    RewardFn,
    available_rewards,
    get_reward_fn,
    register_reward,
)
from verl_trainer.rewards.rule_based import (
    FORMAT_SCORE,
    answers_match,
    extract_answer,
    format_reward,
    is_well_formatted,
    last_boxed,
    math_exact,
    math_reward,
    parse_number,
)
from verl_trainer.rewards.verifiable import (
    KNOWN_DATA_SOURCES,
    RewardTimeoutError,
    check_data_sources,
    configure_score_pool,
    default_compute_score,
)

_COMPUTE = ("ACCURACY_KEY", "BatchScores", "RewardFunctions", "compute_rewards", "place_scores",
            "reward_metrics", "score_batch", "score_responses", "token_level_scores")
"""Names of :mod:`verl_trainer.rewards.compute` (torch), imported on first use: the reward functions
themselves stay light, so a scoring worker process (:mod:`verl_trainer.rewards.verifiable`) starts fast."""


def __getattr__(name: str) -> Any:
    if name in _COMPUTE:
        from verl_trainer.rewards import compute  # lazy: the package's lazy export

        return getattr(compute, name)
    raise AttributeError(f"module 'verl_trainer.rewards' has no attribute {name!r}")


DEFAULT_REWARD = "math"
"""The reward of the default recipes: exact answer 1, well-formatted wrong answer 0.1."""

__all__ = [
    "ACCURACY_KEY",
    "DEFAULT_REWARD",
    "FORMAT_SCORE",
    "BatchScores",
    "KNOWN_DATA_SOURCES",
    "REWARD_REGISTRY",
    "RewardFn",
    "RewardFunctions",
    "RewardTimeoutError",
    "answers_match",
    "available_rewards",
    "check_data_sources",
    "compute_rewards",
    "configure_score_pool",
    "default_compute_score",
    "extract_answer",
    "format_reward",
    "get_reward_fn",
    "is_well_formatted",
    "last_boxed",
    "math_exact",
    "math_reward",
    "parse_number",
    "place_scores",
    "register_reward",
    "reward_metrics",
    "rule_based",
    "score_batch",
    "score_responses",
    "token_level_scores",
    "verifiable",
    "vision",
]
