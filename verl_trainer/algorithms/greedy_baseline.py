"""ReMax's baseline rollout: one greedy response per prompt, scored like the samples, never trained on.

ReMax (Li et al. 2023, arXiv:2310.10505) is REINFORCE whose baseline is the reward of the policy's own
greedy response to the prompt: ``A_i = r(x, y_i) - r(x, y_greedy(x))`` on every token of sample ``y_i``.
An RL recipe gives it to every advantage estimator that reads ``reward_baselines`` (its parameter names
say so: :func:`~verl_trainer.core_algos.advantages.resolve_estimator`; ``remax`` is the built-in one):

1. after the ``n`` samples of each prompt, the rollout decodes the same prompts once more, greedily
   (:func:`generate_greedy_baseline`: ``n=1, do_sample=False``, i.e. temperature 0), with the same
   weights — a second ``generate`` call on the same rollout, so every backend (hf, vllm, the multi-turn
   agent loop, the one-step-off thread) serves it unchanged;
2. each greedy response is scored exactly as a sample (the same reward functions, reward model,
   environment reward and overlong shaping, under the same ``reward.on_error`` and ``non_finite.policy``:
   ``Scorer.rewards``);
3. its reward is written to every sample of its prompt as ``reward_baselines`` ``[B * n]``
   (:func:`attach_reward_baselines`). The greedy responses are then dropped: no loss, no denominator, no
   response metric sees them.

:class:`GreedyBaseline` is the feature as one object plugged into two stages: a part of the rollout stage
(step 1, on whatever thread generates the step's samples) and a part of the scorer (steps 2 and 3).

A greedy response that is dropped (a failed or non-finite reward under a dropping policy) leaves its
prompt without a baseline, so its samples are dropped too.

Why a second call rather than ``n + 1`` samples with one greedy: a ``generate`` call has one sampling
config for all its rows (one vLLM ``SamplingParams``, one ``GenerationConfig``), the greedy row would
change the batch every backend sees, and its ids would have to be cut out of the trained batch again.
The second call costs one extra decoding of ``B`` rows (``n`` times fewer than the samples).

Logged: ``reward/baseline_mean`` (the greedy responses' mean reward, over prompts),
``timing/baseline_rollout_s``; ``reward/baseline_errors``, ``reward/baseline_timeouts`` (failed reward
calls of the greedy responses), ``non_finite/baseline_rewards``, and the dropped counts when a policy drops.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict

from verl_trainer.algorithms.stages import StepMetrics
from verl_trainer.core_algos.advantages import estimator_inputs
from verl_trainer.data import schema
from verl_trainer.metrics import Metric
from verl_trainer.rollout import BaseRollout

if TYPE_CHECKING:  # annotations only: the scorer stage imports nothing of this feature
    from verl_trainer.algorithms.stages.signal import Scorer

__all__ = ["BASELINE_STREAM", "GreedyBaseline", "attach_reward_baselines", "baseline_metrics",
           "generate_greedy_baseline", "reads_reward_baselines"]

BASELINE_STREAM = 2
"""Seed stream of the baseline rollout (0: training samples, 1: validation); greedy decoding draws nothing,
the stream only keeps a backend that seeds anyway off the samples' seeds."""

_RENAMED = {"reward/errors": "reward/baseline_errors", "reward/timeouts": "reward/baseline_timeouts",
            "reward/dropped_samples": "reward/baseline_dropped_samples",
            "non_finite/baseline_rewards": "non_finite/baseline_rewards",
            "non_finite/dropped_samples": "non_finite/baseline_dropped_samples"}
"""The scoring metrics of the greedy responses that are logged, under these names (the rest, e.g. their
``reward/mean``, would overwrite the samples')."""


def reads_reward_baselines(adv_estimator: str | None) -> bool:
    """Whether the advantage estimator named ``adv_estimator`` reads ``reward_baselines`` (``None``: no)."""
    return adv_estimator is not None and "reward_baselines" in estimator_inputs(adv_estimator)


def generate_greedy_baseline(rollout: BaseRollout, prompt_batch: TensorDict, step: int,
                             prompt_index: torch.Tensor) -> TensorDict:
    """One greedy response per prompt, with the rollout's current weights.

    Args:
        rollout: The step's rollout (the weights that sampled the step's responses).
        prompt_batch: This rank's prompt batch ``[B]`` (its ``uid`` the samples' group ids).
        step: The training step (as for the samples).
        prompt_index: ``[B]`` the prompts' dataset indices.

    Returns:
        A rollout batch ``[B]`` (:meth:`BaseRollout.generate`'s schema), row ``i`` answering prompt ``i``.
    """
    return rollout.generate(prompt_batch, step=step, prompt_index=prompt_index, stream=BASELINE_STREAM,
                            n=1, do_sample=False)


def attach_reward_baselines(batch: TensorDict, baseline: TensorDict, scores: torch.Tensor) -> torch.Tensor:
    """Write each prompt's greedy reward to its samples: ``batch["reward_baselines"]`` ``[B * n]`` float32.

    Args:
        batch: The step's samples ``[B * n]``, prompt ``i``'s at rows ``i * n .. i * n + n - 1``.
        baseline: The greedy responses ``[B]`` (:func:`generate_greedy_baseline`), scored; a row that is
            padding (a padding prompt, or a response dropped by a failure policy) has no baseline.
        scores: ``[B]`` their rewards.

    Returns:
        ``[B * n]`` bool: the real samples whose prompt has no baseline (to be dropped by the caller).

    Raises:
        RuntimeError: The two batches do not hold the same prompts in the same order.
    """
    rows, prompts = batch.batch_size[0], baseline.batch_size[0]
    n = rows // max(prompts, 1)
    if n * prompts != rows or not torch.equal(batch[schema.UID], baseline[schema.UID].repeat_interleave(n)):
        raise RuntimeError(f"the baseline rollout ({prompts} responses) does not answer the prompts of the "
                           f"step's {rows} samples in order; generate both from the same prompt batch")
    has_baseline = schema.real_mask(baseline)
    values = torch.where(has_baseline, scores.to(torch.float32), torch.zeros((), dtype=torch.float32))
    batch[schema.REWARD_BASELINES] = values.repeat_interleave(n)
    return ~has_baseline.repeat_interleave(n) & schema.real_mask(batch)


def baseline_metrics(baseline: TensorDict, scores: torch.Tensor, scoring: dict[str, Any]) -> dict[str, Any]:
    """``reward/baseline_mean`` over the real prompts, and the logged part of the baseline's ``scoring``.

    Args:
        baseline: The scored greedy responses ``[B]``.
        scores: ``[B]`` their rewards.
        scoring: The metrics their scoring wrote (failure and non-finite counts are kept, renamed).
    """
    real = schema.real_mask(baseline)
    count = int(real.sum())
    mean = scores[real].float().mean() if count else torch.zeros(())
    metrics: StepMetrics = {"reward/baseline_mean": Metric.mean(mean, weight=count)}
    metrics.update({_RENAMED[k]: v for k, v in scoring.items() if k in _RENAMED})
    return metrics


class GreedyBaseline:
    """ReMax's baseline as a rollout part and a scorer part (see the module docstring).

    The greedy responses are kept per step between the two (one-step-off generates step ``t + 1``'s while
    step ``t`` is scored).
    """

    def __init__(self) -> None:
        self._responses: dict[int, TensorDict] = {}  # single dict operations: safe across the two threads

    def after_rollout(self, rollout: BaseRollout, prompt_batch: TensorDict, step: int,
                      prompt_index: torch.Tensor, metrics: StepMetrics) -> None:
        """Decode the step's prompts greedily with the sampling weights; ``timing/baseline_rollout_s``."""
        start = time.perf_counter()
        baseline = generate_greedy_baseline(rollout, prompt_batch, step, prompt_index)
        self._responses[step] = baseline
        metrics["timing/baseline_rollout_s"] = time.perf_counter() - start

    def after_score(self, scorer: Scorer, batch: TensorDict, scores: torch.Tensor, step: int,
                    metrics: StepMetrics) -> None:
        """Score the step's greedy responses as samples; write ``reward_baselines`` ``[B * n]`` in ``batch``.

        A collective (reward model, failure and non-finite counts). Samples whose greedy response was
        dropped (a dropping failure policy) are dropped too: they have no baseline.

        Raises:
            RuntimeError: No greedy responses were generated for the step.
        """
        baseline = self._responses.pop(step - 1, None)
        for old in [k for k in list(self._responses) if k < step - 1]:  # an unused read-ahead
            self._responses.pop(old, None)
        if baseline is None:
            raise RuntimeError(f"step {step}: no greedy baseline responses (the rollout stage runs this)")
        scoring: StepMetrics = {}
        dropped_before = scorer.guard.dropped
        baseline_scores = scorer.rewards(baseline, step, scoring, what="baseline_rewards")
        orphans = attach_reward_baselines(batch, baseline, baseline_scores)
        scorer.guard.drop_orphans(batch, orphans, dropped_before)
        metrics.update(baseline_metrics(baseline, baseline_scores, scoring))
