"""The "@k" estimators against hand-computed values and against enumerating every k-subset."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from verl_trainer.evaluate import (
    PromptSamples,
    best_at_k,
    default_ks,
    maj_at_k,
    mean_at_k,
    normalize_answer,
    pass_at_k,
    summarize,
    worst_at_k,
)


def test_pass_at_k_hand_computed():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)  # 1 - C(2,2)/C(4,2)
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)  # 1 - C(3,3)/C(5,3)
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(200, 3, 100) == pytest.approx(1 - math.comb(197, 100) / math.comb(200, 100))


def test_best_worst_mean_hand_computed():
    scores = [0.0, 1.0, 0.5, 0.1]
    # the 6 pairs' maxima: .1 .5 1 .5 1 1 -> 4.1 / 6; minima: 0 0 0 .1 .1 .5 -> 0.7 / 6
    assert best_at_k(scores, 2) == pytest.approx(4.1 / 6)
    assert worst_at_k(scores, 2) == pytest.approx(0.7 / 6)
    assert best_at_k(scores, 4) == 1.0 and worst_at_k(scores, 4) == 0.0
    assert best_at_k(scores, 1) == worst_at_k(scores, 1) == mean_at_k(scores, 3) == pytest.approx(1.6 / 4)


def test_maj_at_k_hand_computed():
    answers, correct = ["3", "3", "5", None], [1, 1, 0, 0]
    assert maj_at_k(answers, correct, 1) == pytest.approx(0.5)  # a "3" drawn; None does not vote
    # pairs: {3,3} 1, {3,5} x2 ties 1/2, {3,None} x2 1, {5,None} 0 -> 4 / 6
    assert maj_at_k(answers, correct, 2) == pytest.approx(4 / 6)
    # triples: {3,3,5} 1, {3,3,N} 1, {3,5,N} x2 1/2 -> 3 / 4
    assert maj_at_k(answers, correct, 3) == pytest.approx(0.75)
    assert maj_at_k(answers, correct, 4) == 1.0
    assert maj_at_k([None, None], [0, 0], 2) == 0.0
    # the correct answer is the plurality, not the majority: 2 of 5 with three singletons
    assert maj_at_k(["7", "7", "1", "2", "3"], [1, 1, 0, 0, 0], 5) == 1.0


def _subset_mean(n: int, k: int, value) -> float:
    subsets = list(itertools.combinations(range(n), k))
    return sum(value(s) for s in subsets) / len(subsets)


def _brute_maj(answers, correct, subset) -> float:
    votes: dict[str, int] = {}
    for i in subset:
        if answers[i] is not None:
            votes[answers[i]] = votes.get(answers[i], 0) + 1
    if not votes:
        return 0.0
    top = max(votes.values())
    winners = [a for a, v in votes.items() if v == top]
    share = {a: sum(correct[i] for i in range(len(answers)) if answers[i] == a)
             / sum(1 for x in answers if x == a) for a in winners}
    return sum(share.values()) / len(winners)


@pytest.mark.parametrize("seed", range(12))
def test_estimators_equal_enumeration_of_subsets(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    answers = [rng.choice(["a", "b", "c", None]) for _ in range(n)]
    correct = [float(a == "a") for a in answers]
    scores = [round(rng.uniform(-1, 2), 2) for _ in range(n)]
    for k in range(1, n + 1):
        c = int(sum(correct))
        assert pass_at_k(n, c, k) == pytest.approx(_subset_mean(n, k, lambda s: any(correct[i] for i in s)))
        assert best_at_k(scores, k) == pytest.approx(_subset_mean(n, k, lambda s: max(scores[i] for i in s)))
        assert worst_at_k(scores, k) == pytest.approx(_subset_mean(n, k, lambda s: min(scores[i] for i in s)))
        mean = _subset_mean(n, k, lambda s: sum(scores[i] for i in s) / len(s))
        assert mean_at_k(scores, k) == pytest.approx(mean)
        assert maj_at_k(answers, correct, k) == pytest.approx(
            _subset_mean(n, k, lambda s: _brute_maj(answers, correct, s)))


def test_maj_at_k_large_n_does_not_overflow():
    # n = 1200: C(1200, 64) ~ 1e107, C(1200, 600) ~ 1e359; exact counts in floats would overflow
    answers = ["1"] * 700 + ["2"] * 500
    correct = [1.0] * 700 + [0.0] * 500
    value = maj_at_k(answers, correct, 64)
    assert 0.5 < value < 1.0 and math.isfinite(value)
    assert maj_at_k(answers, correct, 1) == pytest.approx(700 / 1200)


def test_k_larger_than_n_is_an_error():
    with pytest.raises(ValueError, match=r"k=5 is larger than the n=4 samples"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c=5 correct samples out of n=4"):
        pass_at_k(4, 5, 2)


def test_default_ks_and_normalize_answer():
    assert default_ks(1) == [1] and default_ks(8) == [1, 2, 4, 8] and default_ks(6) == [1, 2, 4, 6]
    assert normalize_answer("1,000") == normalize_answer(" $1000.0 ") == "1000"
    assert normalize_answer("0.50") == "0.5"
    assert normalize_answer(r"\frac{1} {2}") == r"\frac{1}{2}"
    assert normalize_answer("  ") is None and normalize_answer(None) is None


def test_summarize_overall_and_per_source():
    p1 = PromptSamples(0, "gsm8k", [1.0, 0.0], [1.0, 0.0], ["4", "5"])
    p2 = PromptSamples(1, "math", [0.0, 0.0], [0.0, 0.0], ["1", None])
    p3 = PromptSamples(2, "gsm8k", [1.0, 1.0], [1.0, 1.0], ["9", "9"])
    metrics, per_source = summarize([p1, p2, p3], [1, 2])
    assert metrics["pass@1"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert metrics["pass@2"] == pytest.approx((1 + 0 + 1) / 3)
    assert metrics["maj@2"] == pytest.approx((0.5 + 0 + 1) / 3)  # p1: a tie of "4" and "5"
    assert metrics["num_prompts"] == 3 and metrics["num_samples"] == 6
    assert list(per_source) == ["gsm8k", "math"]
    assert per_source["gsm8k"]["pass@2"] == 1.0 and per_source["gsm8k"]["num_prompts"] == 2
    assert per_source["math"]["best@2"] == 0.0
