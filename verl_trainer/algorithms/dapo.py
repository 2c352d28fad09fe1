"""DAPO's data-side options (Yu et al. 2025, arXiv:2503.14476): dynamic sampling, overlong shaping.

The loss-side options are settings of :class:`~verl_trainer.core_algos.losses.PPOLossConfig`: clip-higher
(``clip_ratio_high > clip_ratio_low``) and ``loss_agg_mode="token-mean"``.

* **Dynamic sampling** (:func:`dynamic_sampling_filter`): a prompt group whose rewards are all equal has
  zero group-relative advantage, so it only dilutes the token-mean denominator; its samples are dropped
  before the update. verl regenerates until the batch is full again; here the step trains on what is
  left (fewer samples), and the ranks agree on the counts so that none is left without samples or with
  a different number of engine steps (a hang): a rank whose groups were all dropped keeps one
  ``is_padding`` sample (zero loss mask), and when every rank dropped everything the update is skipped
  on all of them together.
* **Overlong reward shaping** (:func:`overlong_penalty`): a linear penalty in the last ``buffer_len``
  tokens before the length limit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_trainer.algorithms.stages import StepMetrics
from verl_trainer.data import schema
from verl_trainer.metrics import Metric
from verl_trainer.utils.distributed import all_reduce

__all__ = ["DynamicSampling", "dynamic_sampling_filter", "overlong_penalty", "uniform_groups"]


def overlong_penalty(response_len: torch.Tensor, max_len: int, buffer_len: int,
                     penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (verl's ``overlong_buffer``).

    ``min(0, (max_len - buffer_len - l) / buffer_len) * penalty_factor``: 0 for responses of at most
    ``max_len - buffer_len`` tokens, then linearly down to ``-penalty_factor`` at ``max_len``.

    Args:
        response_len: ``[B]`` response lengths in tokens.
        max_len: The response length limit (``rollout.max_new_tokens``).
        buffer_len: Length of the penalised zone (``1 <= buffer_len <= max_len``).
        penalty_factor: Penalty at ``max_len``.

    Returns:
        ``[B]`` float32 penalties (``<= 0``), to add to the outcome rewards.
    """
    if not 1 <= buffer_len <= max_len:
        raise ValueError(f"buffer_len={buffer_len} must be in [1, max_len={max_len}]")
    exceed = response_len.to(torch.float32) - (max_len - buffer_len)
    return torch.clamp(-exceed / buffer_len, max=0.0) * penalty_factor


def uniform_groups(scores: torch.Tensor, uids: torch.Tensor) -> torch.Tensor:
    """Which samples belong to a group whose scores are all equal.

    Args:
        scores: ``[B]`` outcome rewards.
        uids: ``[B]`` group ids (groups whole on this rank).

    Returns:
        ``[B]`` bool.
    """
    if scores.numel() == 0:
        return torch.zeros(0, dtype=torch.bool)
    _, inverse = torch.unique(uids, return_inverse=True)
    num = int(inverse.max()) + 1
    values = scores.to(torch.float64)
    gmax = torch.full((num,), -torch.inf, dtype=torch.float64).scatter_reduce(0, inverse, values, "amax")
    gmin = torch.full((num,), torch.inf, dtype=torch.float64).scatter_reduce(0, inverse, values, "amin")
    return (gmax == gmin)[inverse]


def dynamic_sampling_filter(
    batch: TensorDict, scores: torch.Tensor, group: dist.ProcessGroup | None = None, dp_size: int = 1
) -> tuple[TensorDict, bool, dict[str, Metric]]:
    """Drop the groups whose rewards are all equal; agree over the DP ranks on what is left.

    Collective over ``group`` (one all-reduce of two numbers).

    Args:
        batch: This rank's tensor-only step batch ``[B]`` (``uid``; ``is_padding`` optional).
        scores: ``[B]`` the rewards the advantages were computed from.
        group: The DP group.
        dp_size: Its size (for the SUM metric's ``x dp`` convention).

    Returns:
        ``(kept, any_left, metrics)``: this rank's kept samples (at least one row: an ``is_padding``
        sample when none is left here), whether any rank kept a real sample (the same on every rank;
        skip the update when ``False``), and ``dapo/kept_group_frac`` (MEAN over groups) and
        ``dapo/kept_samples`` (the global count).
    """
    real = schema.real_mask(batch)
    drop = uniform_groups(scores, batch[schema.UID])
    keep = ~drop & real
    uids = batch[schema.UID][real]
    num_groups = int(torch.unique(uids).numel())
    kept_groups = int(torch.unique(batch[schema.UID][keep]).numel())
    kept = batch[keep.nonzero().squeeze(1)]
    if kept.batch_size[0] == 0:
        kept = schema.padding_samples(batch, 1)
    local = torch.tensor([float(keep.sum())], dtype=torch.float64)
    any_left = float(all_reduce(local, group)[0]) > 0
    metrics = {
        "dapo/kept_group_frac": Metric.mean(kept_groups / max(num_groups, 1), weight=num_groups),
        "dapo/kept_samples": Metric.sum(float(keep.sum()) * dp_size),
    }
    return kept, any_left, metrics


class DynamicSampling:
    """The advantages stage's selection part for ``dynamic_sampling``: :func:`dynamic_sampling_filter`.

    Args:
        dp_group: The DP process group.
        dp_size: Its size.
    """

    def __init__(self, dp_group: dist.ProcessGroup | None = None, dp_size: int = 1) -> None:
        self.dp_group = dp_group
        self.dp_size = dp_size

    def __call__(self, batch: TensorDict, scores: torch.Tensor,
                 metrics: StepMetrics) -> tuple[TensorDict, bool]:
        """``(kept, any_left)``; adds ``dapo/kept_group_frac`` and ``dapo/kept_samples`` to ``metrics``."""
        kept, any_left, dapo_metrics = dynamic_sampling_filter(batch, scores, self.dp_group, self.dp_size)
        metrics.update(dapo_metrics)
        return kept, any_left
