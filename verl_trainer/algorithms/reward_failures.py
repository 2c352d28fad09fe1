"""Failed reward calls inside an RL step: counted over the DP group, then an error, dropped or zero.

The policy is ``algorithm.reward.on_error`` (:mod:`verl_trainer.rewards.failures`). Every rank scores its
own samples, so a failure on one rank must not raise there alone (the others would wait forever in the
next collective): the counts are all-reduced first, and under ``error`` every rank raises the same
:class:`~verl_trainer.rewards.failures.RewardError`, naming the failed calls of every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from verl_trainer.algorithms.distributed import drop_samples
from verl_trainer.data import schema
from verl_trainer.rewards.compute import FAILED_KEY, RewardFunctions
from verl_trainer.rewards.failures import RewardError, describe_failures, policy_hint
from verl_trainer.utils.distributed import all_gather_object, all_reduce, get_rank

__all__ = ["check_reward_failures"]


def check_reward_failures(reward_fn: RewardFunctions, batch: TensorDict, scores: torch.Tensor,
                          info: dict[str, torch.Tensor], step: int, group: Any, metrics: dict[str, Any],
                          group_estimator: bool = False, prefix: str = "reward") -> int:
    """Count, then raise or drop, the samples whose reward call failed (a collective over ``group``).

    Args:
        reward_fn: The functions that scored ``batch`` (their ``failures`` are the last call's).
        batch: This rank's scored batch ``[B]`` (``uid``, ``is_padding``); dropped samples become padding.
        scores: ``[B]`` scores; a dropped sample's is set to 0.
        info: The scoring's per-sample extras (``FAILED_KEY`` ``[B]``).
        step: The step (1-based), for messages.
        group: The DP process group.
        metrics: Step outputs: ``{prefix}/errors`` and ``{prefix}/timeouts`` (counts over the group) are
            set, and ``{prefix}/dropped_samples`` under ``drop``.
        group_estimator: Drop a failed sample's whole prompt group (its advantages need all of it).
        prefix: Metric prefix (``val/reward`` in validation).

    Returns:
        The samples dropped over the group (0 unless ``on_error="drop"``).

    Raises:
        RewardError: Under ``on_error="error"``, on every rank, when any rank had a failed call.
    """
    real = schema.real_mask(batch)
    mine = [f for f in reward_fn.failures if bool(real[f.index])]
    timeouts = sum(f.timeout for f in mine)
    counts = torch.tensor([len(mine) - timeouts, timeouts], dtype=torch.float64)
    errors, timed_out = (int(v) for v in all_reduce(counts, group).tolist())
    metrics[f"{prefix}/errors"], metrics[f"{prefix}/timeouts"] = float(errors), float(timed_out)
    if errors + timed_out == 0 or reward_fn.on_error == "zero":
        return 0
    if reward_fn.on_error == "error":
        uids = batch[schema.UID].tolist() if schema.UID in batch.keys() else None
        rank = get_rank()
        described = [f.describe(f", uid {uids[f.index]}, rank {rank}" if uids else f", rank {rank}")
                     for f in mine[:4]]
        everyone = [d for part in all_gather_object(described, group) for d in part]
        raise RewardError(f"step {step}: {errors + timed_out} reward call(s) failed ({timed_out} timed out): "
                          f"{describe_failures(everyone, errors + timed_out)}; {policy_hint()}")
    drop, dropped = drop_samples(batch, info[FAILED_KEY].bool() & real, group_estimator, group)
    scores[drop] = 0.0
    metrics[f"{prefix}/dropped_samples"] = float(dropped)
    if get_rank() == 0:
        print(f"step {step}: dropped {dropped} sample(s) for {errors + timed_out} failed reward call(s)",
              flush=True)
    return dropped
