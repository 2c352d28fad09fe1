r"""Per-prompt estimators of the "@k" numbers people report, from ``n >= k`` samples of one prompt.

Each "@k" value is the **expectation over a uniformly random k-subset** of the prompt's ``n`` samples,
computed exactly (no bootstrap, no sampling), so it is an unbiased estimate of the value of ``k`` fresh
samples and uses all ``n``:

* ``pass@k`` (Chen et al. 2021): the chance that at least one of ``k`` samples is correct,
  ``1 - C(n - c, k) / C(n, k)`` with ``c`` correct samples.
* ``best@k`` / ``worst@k``: the expected largest / smallest score of ``k`` samples. With the scores
  sorted ascending ``s_1 <= ... <= s_n``, ``s_i`` is the largest of a k-subset in ``C(i-1, k-1)`` of the
  ``C(n, k)`` subsets (the smallest in ``C(n-i, k-1)``). verl's ``best@k`` bootstraps this instead,
  which is biased (it resamples with replacement).
* ``mean@k``: the expected mean score of ``k`` samples, which is the mean of all ``n`` (the same for
  every ``k``; it is listed per ``k`` so tables line up).
* ``maj@k``: the chance that the majority vote over the ``k`` samples' extracted answers is a correct
  answer. Samples without an answer (``None``) do not vote; a tie between answers is broken uniformly at
  random (so a tie of two answers, one of them correct, counts 1/2); a subset where nobody votes counts 0.
  Computed exactly by counting subsets per winning answer (:func:`maj_at_k`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["best_at_k", "check_k", "maj_at_k", "mean_at_k", "pass_at_k", "worst_at_k"]


def check_k(n: int, k: int) -> None:
    """Raise ``ValueError`` unless ``1 <= k <= n``."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r} must be an int >= 1")
    if k > n:
        raise ValueError(f"k={k} is larger than the n={n} samples of a prompt; draw n >= {k} samples "
                         f"(eval.n / val_rollout.n) or drop k={k} from the list of k")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt: ``1 - C(n - c, k) / C(n, k)``.

    Args:
        n: Samples drawn.
        c: Correct samples among them (``0 <= c <= n``).
        k: Budget (``1 <= k <= n``).

    Returns:
        The probability that a random k-subset holds at least one correct sample.
    """
    check_k(n, k)
    if not 0 <= c <= n:
        raise ValueError(f"c={c} correct samples out of n={n}: c must be in [0, n]")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _order_weights(n: int, k: int, largest: bool) -> np.ndarray:
    """``[n]``: chance that the i-th smallest (``largest``; else largest) score is a k-subset's extreme."""
    total = math.comb(n, k)
    ranks = range(n) if largest else range(n - 1, -1, -1)
    return np.array([math.comb(r, k - 1) / total for r in ranks], dtype=np.float64)


def best_at_k(scores: Sequence[float], k: int) -> float:
    """Expected maximum score of a random k-subset of ``scores`` (``[n]``)."""
    check_k(len(scores), k)
    s = np.sort(np.asarray(scores, dtype=np.float64))
    return float((_order_weights(len(s), k, largest=True) * s).sum())


def worst_at_k(scores: Sequence[float], k: int) -> float:
    """Expected minimum score of a random k-subset of ``scores`` (``[n]``)."""
    check_k(len(scores), k)
    s = np.sort(np.asarray(scores, dtype=np.float64))
    return float((_order_weights(len(s), k, largest=False) * s).sum())


def mean_at_k(scores: Sequence[float], k: int) -> float:
    """Expected mean score of a random k-subset of ``scores`` (``[n]``): the mean of all of them."""
    check_k(len(scores), k)
    return float(np.mean(np.asarray(scores, dtype=np.float64)))


def _binomial_weights(m: int, upto: int, p: float) -> np.ndarray:
    """``[upto + 1]``: ``C(m, x) p^x (1-p)^(m-x)`` for ``x = 0..upto`` (0 beyond ``m``), overflow-free."""
    out = np.zeros(upto + 1, dtype=np.float64)
    for x in range(min(m, upto) + 1):
        if p >= 1.0:
            out[x] = 1.0 if x == m else 0.0
        else:
            log = (math.lgamma(m + 1) - math.lgamma(x + 1) - math.lgamma(m - x + 1)
                   + x * math.log(p) + (m - x) * math.log1p(-p))
            out[x] = math.exp(log)
    return out


def _win_chance(m_w: int, others: list[int], abstain: int, n: int, k: int) -> float:
    """The chance that an answer with ``m_w`` votes wins the vote of a random k-subset.

    Counts the subsets where the answer takes ``j >= 1`` samples, every other answer fewer than ``j`` or
    exactly ``j`` (a tie: ``t`` tied answers give it ``1 / (t + 1)``), and non-voters any number. Each
    count ``prod C(m_g, x_g)`` is scaled by ``p^k (1-p)^(n-k)`` (``p = k / n``: binomial weights, which
    cannot overflow) and the sum divided by the same factor of ``C(n, k)``.
    """
    p = k / n
    norm = _binomial_weights(n, k, p)[k]  # C(n, k) p^k (1-p)^(n-k)
    abstain_w = _binomial_weights(abstain, k, p)
    total = 0.0
    mine = _binomial_weights(m_w, k, p)
    for j in range(1, min(m_w, k) + 1):
        rest = k - j
        max_ties = min(len(others), rest // j)
        # state[size, ties]: weighted count of ways the other answers take `size` samples with `ties` at j
        state = np.zeros((rest + 1, max_ties + 1), dtype=np.float64)
        state[:, 0] = abstain_w[: rest + 1]
        for m in others:
            w = _binomial_weights(m, min(m, j), p)
            new = np.zeros_like(state)
            for x in range(min(m, j, rest) + 1):
                if x < j:
                    new[x:, :] += w[x] * state[: rest + 1 - x, :]
                else:
                    new[x:, 1:] += w[x] * state[: rest + 1 - x, :-1]
            state = new
        tie_share = 1.0 / np.arange(1, max_ties + 2, dtype=np.float64)
        total += mine[j] * float(state[rest] @ tie_share)
    return total / norm


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool | float], k: int) -> float:
    """Expected correctness of the majority answer of a random k-subset (see the module docstring).

    Args:
        answers: ``[n]`` the samples' extracted answers, normalised so that equal answers are equal strings
            (``None``: no answer, no vote).
        correct: ``[n]`` each sample's correctness (bool or a fraction in ``[0, 1]``); an answer's
            correctness is the mean over its samples.
        k: Budget (``1 <= k <= n``).

    Returns:
        The probability that the vote's winner is a correct answer.
    """
    n = len(answers)
    if len(correct) != n:
        raise ValueError(f"maj_at_k got {n} answers and {len(correct)} correctness values; they must match")
    check_k(n, k)
    votes: dict[str, list[float]] = {}
    abstain = 0
    for answer, ok in zip(answers, correct):
        if answer is None:
            abstain += 1
        else:
            votes.setdefault(answer, []).append(float(ok))
    counts = {a: len(v) for a, v in votes.items()}
    result = 0.0
    for answer, oks in votes.items():
        share = sum(oks) / len(oks)
        if share == 0.0:
            continue
        others = [m for a, m in counts.items() if a != answer]
        result += share * _win_chance(counts[answer], others, abstain, n, k)
    return min(max(result, 0.0), 1.0)
