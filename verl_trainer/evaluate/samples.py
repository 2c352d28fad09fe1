r"""The scored samples of each prompt, and the "@k" numbers of one prompt and of a set of prompts.

A :class:`PromptSamples` holds one prompt's ``n`` samples: their scores, whether each is correct and the
answer each one gives. :func:`prompt_samples` builds them from a scored rollout batch;
:func:`summarize` averages the per-prompt estimators (:mod:`verl_trainer.evaluate.estimators`) over the
prompts, overall and per ``data_source``.

A sample is **correct** when its reward reports ``acc`` (verl's convention; ``math``, ``math_exact``,
:func:`verl_trainer.rewards.default_compute_score`) and it is 1 (or its fraction when between), else when
its score is at least ``correct_threshold`` (default 1.0). Its **answer** (for ``maj@k``) is the final
answer of the response (:func:`verl_trainer.rewards.extract_answer`: after ``####``, in the last
``\boxed{}``, else the last number), normalised by :func:`normalize_answer`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from verl_trainer.evaluate.estimators import best_at_k, check_k, maj_at_k, mean_at_k, pass_at_k, worst_at_k
from verl_trainer.rewards import ACCURACY_KEY, extract_answer, parse_number

__all__ = [
    "ESTIMATORS",
    "PromptSamples",
    "default_ks",
    "metric_names",
    "normalize_answer",
    "prompt_samples",
    "summarize",
]

ESTIMATORS = ("pass", "maj", "mean", "best", "worst")
"""The reported estimators; ``f"{name}@{k}"`` is a metric name."""


def default_ks(n: int) -> list[int]:
    """``[1, 2, 4, ..., n]``: powers of two below ``n``, and ``n`` (verl's choice for validation)."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]


def metric_names(ks: Sequence[int]) -> list[str]:
    """``["pass@1", "maj@1", ..., "worst@K"]`` in table order (per ``k``, the estimators)."""
    return [f"{name}@{k}" for k in ks for name in ESTIMATORS]


def normalize_answer(answer: str | None) -> str | None:
    r"""An answer as the string votes are counted on: a number in canonical form, else trimmed text.

    ``"1,000"``, ``"1000.0"`` and ``" $1000 "`` all become ``"1000"``; ``"\frac{1}{2}"`` stays as written
    (without spaces); an empty answer is ``None`` (no vote).
    """
    if answer is None:
        return None
    number = parse_number(answer)
    if number is not None:
        return str(int(number)) if number.is_integer() else repr(number)
    text = "".join(str(answer).split())
    return text or None


@dataclass
class PromptSamples:
    """The ``n`` scored samples of one prompt.

    Attributes:
        index: The prompt's row in its file (its ``uid``).
        data_source: Its ``data_source``.
        scores: ``[n]`` rewards.
        correct: ``[n]`` correctness in ``[0, 1]``.
        answers: ``[n]`` normalised answers (``None``: no answer).
        prompt: The prompt as written in its file (text or chat messages); ``None`` when not given.
        responses: ``[n]`` the responses' text (empty when not given).
    """

    index: int
    data_source: str
    scores: list[float]
    correct: list[float]
    answers: list[str | None] = field(default_factory=list)
    prompt: Any = None
    responses: list[str] = field(default_factory=list)

    @property
    def n(self) -> int:
        """Samples drawn."""
        return len(self.scores)

    @property
    def num_correct(self) -> int:
        """Correct samples (a fractional correctness counts when >= 0.5)."""
        return sum(1 for c in self.correct if c >= 0.5)

    def metrics(self, ks: Sequence[int]) -> dict[str, float]:
        """``{"pass@k", "maj@k", "mean@k", "best@k", "worst@k"}`` of this prompt for each ``k``."""
        out: dict[str, float] = {}
        for k in ks:
            check_k(self.n, k)
            out[f"pass@{k}"] = pass_at_k(self.n, self.num_correct, k)
            out[f"maj@{k}"] = maj_at_k(self.answers, self.correct, k)
            out[f"mean@{k}"] = mean_at_k(self.scores, k)
            out[f"best@{k}"] = best_at_k(self.scores, k)
            out[f"worst@{k}"] = worst_at_k(self.scores, k)
        return out


def prompt_samples(uids: Sequence[int], data_sources: Sequence[str], texts: Sequence[str],
                   scores: torch.Tensor, info: Mapping[str, torch.Tensor] | None = None,
                   correct_threshold: float = 1.0, prompts: Sequence[Any] | None = None
                   ) -> list[PromptSamples]:
    """Group ``B`` scored samples by prompt (``uid``), in order of first appearance.

    Args:
        uids: ``[B]`` the prompt each sample answers.
        data_sources: ``[B]``.
        texts: ``[B]`` the responses (their answers are extracted for ``maj@k``).
        scores: ``[B]`` rewards.
        info: The reward's other per-sample values (``acc`` ``[B]`` is the correctness when present).
        correct_threshold: Without ``acc``: a sample is correct when its score is at least this.
        prompts: ``[B]`` the prompt each sample answers, as written; given, each group keeps its prompt and
            its responses' text.

    Returns:
        One :class:`PromptSamples` per distinct ``uid``.
    """
    b = len(texts)
    if not len(uids) == len(data_sources) == scores.numel() == b:
        raise ValueError(f"prompt_samples got {len(uids)} uids, {len(data_sources)} data sources, {b} texts "
                         f"and {scores.numel()} scores; they must match")
    acc = (info or {}).get(ACCURACY_KEY)
    values = scores.detach().to(torch.float64).cpu().tolist()
    correct = (acc.detach().to(torch.float64).cpu().tolist() if acc is not None
               else [1.0 if s >= correct_threshold else 0.0 for s in values])
    groups: dict[int, PromptSamples] = {}
    for i in range(b):
        uid = int(uids[i])
        group = groups.get(uid)
        if group is None:
            group = groups[uid] = PromptSamples(uid, str(data_sources[i]), [], [], [])
            if prompts is not None:
                group.prompt = prompts[i]
        elif group.data_source != str(data_sources[i]):
            raise ValueError(f"prompt {uid} has samples from data sources {group.data_source!r} and "
                             f"{data_sources[i]!r}; the samples of one prompt share its uid and data source")
        group.scores.append(values[i])
        group.correct.append(min(max(correct[i], 0.0), 1.0))
        group.answers.append(normalize_answer(extract_answer(texts[i])))
        if prompts is not None:
            group.responses.append(str(texts[i]))
    return list(groups.values())


def _mean_over(prompts: Sequence[PromptSamples], ks: Sequence[int]) -> dict[str, float]:
    rows = [p.metrics(ks) for p in prompts]
    names = metric_names(ks)
    if not rows:
        return {name: math.nan for name in names}
    return {name: sum(r[name] for r in rows) / len(rows) for name in names}


def summarize(prompts: Sequence[PromptSamples], ks: Sequence[int]
              ) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Mean over prompts of each prompt's "@k" numbers, overall and per ``data_source``.

    Args:
        prompts: Scored prompts (every one with at least ``max(ks)`` samples).
        ks: The budgets.

    Returns:
        ``(metrics, per_source)``: ``metrics[f"{estimator}@{k}"]`` plus ``num_prompts`` and
        ``num_samples``; ``per_source[data_source]`` the same over that source's prompts.
    """
    def block(group: Sequence[PromptSamples]) -> dict[str, Any]:
        return {**_mean_over(group, ks), "num_prompts": len(group), "num_samples": sum(p.n for p in group)}

    by_source: dict[str, list[PromptSamples]] = {}
    for p in prompts:
        by_source.setdefault(p.data_source, []).append(p)
    return block(prompts), {source: block(group) for source, group in sorted(by_source.items())}
