"""Rule-based rewards: a registry of verl-compatible reward functions, and batch scoring.

``get_reward_fn("math")`` (or ``"math_exact"``, ``"format"``, ``"my_pkg.rewards:fn"``,
``"path/to/file.py:fn"``) returns a function with verl's ``compute_score`` signature;
``score_batch(batch, reward_fn)`` scores a rollout batch, writes ``token_level_scores`` and returns the
reward metrics.
"""

from verl_trainer.rewards import rule_based
from verl_trainer.rewards.compute import (
    ACCURACY_KEY,
    RewardFunctions,
    compute_rewards,
    reward_metrics,
    score_batch,
    token_level_scores,
)
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
    math_exact,
    math_reward,
    parse_number,
)

DEFAULT_REWARD = "math"
"""The reward of the default recipes: exact answer 1, well-formatted wrong answer 0.1."""

__all__ = [
    "ACCURACY_KEY",
    "DEFAULT_REWARD",
    "FORMAT_SCORE",
    "REWARD_REGISTRY",
    "RewardFn",
    "RewardFunctions",
    "answers_match",
    "available_rewards",
    "compute_rewards",
    "extract_answer",
    "format_reward",
    "get_reward_fn",
    "is_well_formatted",
    "math_exact",
    "math_reward",
    "parse_number",
    "register_reward",
    "reward_metrics",
    "rule_based",
    "score_batch",
    "token_level_scores",
]
