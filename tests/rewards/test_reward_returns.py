"""A reward returning something that is not a score is named with the reward function and the sample."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl_trainer.rewards.compute import compute_rewards
from verl_trainer.rewards.failures import RewardError
from verl_trainer.rewards.results import RewardReturnError

TEXTS, TRUTHS, SOURCES = ["12", "a long response " * 8, "7"], ["12", "3", "7"], ["math", "gsm", "math"]


def _verl(value):
    def bad_on_the_second(data_source, solution_str, ground_truth):
        return value if solution_str.startswith("a long") else 1.0
    return bad_on_the_second


@pytest.mark.parametrize("value, returned", [
    (None, "NoneType None"), ([1.0], r"list \[1.0\]"), ("0.5", "str '0.5'"),
    (torch.tensor([1.0, 2.0]), "Tensor tensor"), (1 + 2j, "complex"),
])
def test_a_verl_reward_returning_no_number_is_named_with_the_sample(value, returned):
    sample = r"reward function bad_on_the_second failed on sample 1 \(data source 'gsm', response 'a long "
    # a failed call of that sample (algorithm.reward.on_error, error by default): function, sample, value
    with pytest.raises(RewardError, match=rf"{sample}.*'\): returned {returned}.*; it must return a number"):
        compute_rewards(TEXTS, TRUTHS, SOURCES, _verl(value))
    with pytest.raises(RewardError, match=rf"{sample}.*'\): returned 'score' {returned}"):
        compute_rewards(TEXTS, TRUTHS, SOURCES, _verl({"score": value}))


def test_numbers_of_every_kind_still_score():
    for value in (True, 2, 0.5, np.float32(0.25), np.array(0.75), torch.tensor(1.5)):
        scores = compute_rewards(TEXTS, TRUTHS, SOURCES, _verl(value))
        assert scores.tolist() == [1.0, pytest.approx(float(value)), 1.0]


def test_a_trl_reward_with_a_wrong_entry_names_it():
    def trl_reward(completions, **kwargs):
        return [1.0, [0.5], None]

    with pytest.raises(RewardError, match=r"reward function trl_reward failed on sample 1 \(data source 'gsm'"
                                          r".*returned list \[0.5\]; each entry must be a number or None"):
        compute_rewards(TEXTS, TRUTHS, SOURCES, trl_reward, columns=[{"prompt": "p"}] * 3)
    with pytest.raises(RewardReturnError, match="returned float 1.0; it must return a list of 3 numbers"):
        compute_rewards(TEXTS, TRUTHS, SOURCES, lambda completions, **k: 1.0, columns=[{"prompt": "p"}] * 3)
