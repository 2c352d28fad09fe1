"""Scoring a batch: reward function over the samples, scores placed on tokens, reward metrics.

Outcome rewards are one scalar per sample. :func:`token_level_scores` puts it on the **last response
token** of the sample (the eos when the response stopped), the position verl uses, so that summing
``token_level_scores`` over the response gives the scalar back and GRPO/RLOO/GAE read it there.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict

from verl_trainer.data import schema
from verl_trainer.data.prompts import non_tensor_list, non_tensor_lists
from verl_trainer.metrics import Metric
from verl_trainer.rewards.registry import RewardFn, get_reward_fn

ACCURACY_KEY = "acc"
"""A reward function's per-sample correctness entry; logged as ``{prefix}/accuracy``."""


def _accepts_extra_info(fn: RewardFn) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return "extra_info" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def compute_rewards(
    texts: Sequence[str],
    ground_truths: Sequence[Any],
    data_sources: Sequence[str],
    reward_fn: str | RewardFn,
    extra_infos: Sequence[Mapping[str, Any] | None] | None = None,
    return_info: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Score every response with a rule-based reward function.

    Args:
        texts: ``B`` decoded responses.
        ground_truths: ``B`` ground truths.
        data_sources: ``B`` data-source names.
        reward_fn: A function (verl ``compute_score`` signature) or a name / ``"module:function"`` for
            :func:`verl_trainer.rewards.get_reward_fn`.
        extra_infos: ``B`` dicts passed as ``extra_info`` (when the function accepts it).
        return_info: Also return the other numeric entries of dict results.

    Returns:
        ``scores`` ``[B]`` float32; with ``return_info``, ``(scores, info)`` where ``info[key]`` is
        ``[B]`` float32 for every key any dict result reported besides ``"score"`` (0 where a sample
        did not report it).

    """
    b = len(texts)
    n_extra = b if extra_infos is None else len(extra_infos)
    if not len(ground_truths) == len(data_sources) == n_extra == b:
        raise ValueError(
            f"compute_rewards got {b} texts, {len(ground_truths)} ground truths, {len(data_sources)} data "
            f"sources{'' if extra_infos is None else f', {len(extra_infos)} extra_infos'}; they must match"
        )
    fn = get_reward_fn(reward_fn)
    pass_extra = _accepts_extra_info(fn)
    scores = torch.zeros(b, dtype=torch.float32)
    info: dict[str, torch.Tensor] = {}
    for i in range(b):
        kwargs = {"extra_info": extra_infos[i] if extra_infos is not None else None} if pass_extra else {}
        result = fn(data_sources[i], texts[i], ground_truths[i], **kwargs)
        if isinstance(result, Mapping):
            if "score" not in result:
                raise ValueError(f"reward function {fn!r} returned a dict without 'score': {dict(result)}")
            for key, value in result.items():
                if key != "score" and isinstance(value, (int, float, bool)):
                    info.setdefault(key, torch.zeros(b, dtype=torch.float32))[i] = float(value)
            result = result["score"]
        scores[i] = float(result)
    return (scores, info) if return_info else scores


def token_level_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sample's scalar score on its last response token.

    Args:
        scores: ``[B]`` outcome scores.
        response_mask: ``[B, T]`` (1 on the response tokens), aligned with ``input_ids``.

    Returns:
        ``[B, T]`` float32, zero except at the last response token of each row; a row without response
        tokens is all zero.

    """
    mask = response_mask.bool()
    b, t = mask.shape
    if scores.shape != (b,):
        raise ValueError(f"scores have shape {tuple(scores.shape)}, expected ({b},) for a [{b}, {t}] mask")
    last = t - 1 - mask.flip(-1).to(torch.long).argmax(-1)
    has_response = mask.any(-1)
    out = torch.zeros((b, t), dtype=torch.float32, device=mask.device)
    rows = torch.arange(b, device=mask.device)[has_response]
    out[rows, last[has_response]] = scores.to(device=mask.device, dtype=torch.float32)[has_response]
    return out


def reward_metrics(
    scores: torch.Tensor,
    info: Mapping[str, torch.Tensor] | None = None,
    uids: torch.Tensor | None = None,
    is_padding: torch.Tensor | None = None,
    prefix: str = "reward",
) -> dict[str, Metric]:
    """Reward metrics of this rank's samples, with reductions valid over ranks.

    Args:
        scores: ``[B]`` scores.
        info: Extra per-sample values from :func:`compute_rewards` (``"acc"`` becomes
            ``{prefix}/accuracy``; every other key ``{prefix}/{key}``), each ``[B]``.
        uids: ``[B]`` group ids; adds ``{prefix}/zero_std_group_frac``: the fraction of prompt groups
            whose samples all scored the same (no GRPO signal). Groups must be whole on this rank.
        is_padding: ``[B]`` bool; padding samples are left out of every metric.
        prefix: Metric-name prefix.

    Returns:
        ``{name: Metric}``: ``/mean`` (MEAN weighted by the sample count), ``/min``, ``/max``, the info
        means, and the group fraction.

    """
    real = torch.ones_like(scores, dtype=torch.bool) if is_padding is None else ~is_padding.bool()
    values = scores[real].float()
    count = int(real.sum())
    mean = values.mean() if count else torch.zeros(())
    metrics = {
        f"{prefix}/mean": Metric.mean(mean, weight=count),
        f"{prefix}/min": Metric.min(values),
        f"{prefix}/max": Metric.max(values),
    }
    for key, per_sample in (info or {}).items():
        v = per_sample[real].float()
        name = "accuracy" if key == ACCURACY_KEY else key
        metrics[f"{prefix}/{name}"] = Metric.mean(v.mean() if count else torch.zeros(()), weight=count)
    if uids is not None:
        groups, inverse = torch.unique(uids[real], return_inverse=True)
        num = groups.numel()
        if num:
            gmax = torch.full((num,), -torch.inf).scatter_reduce(0, inverse, values, "amax")
            gmin = torch.full((num,), torch.inf).scatter_reduce(0, inverse, values, "amin")
            frac = (gmax == gmin).float().mean()
        else:
            frac = torch.zeros(())
        metrics[f"{prefix}/zero_std_group_frac"] = Metric.mean(frac, weight=num)
    return metrics


def _response_texts(batch: TensorDict, tokenizer: Any) -> list[str]:
    if "response_text" in batch.keys():
        return non_tensor_list(batch, "response_text")
    if tokenizer is None:
        raise ValueError("the batch has no 'response_text'; pass the tokenizer to decode the responses")
    ids, start, length = batch[schema.INPUT_IDS], batch[schema.PROMPT_LEN], batch[schema.RESPONSE_LEN]
    return [tokenizer.decode(ids[i, s: s + n].tolist(), skip_special_tokens=True)
            for i, (s, n) in enumerate(zip(start.tolist(), length.tolist()))]


def score_batch(batch: TensorDict, reward_fn: str | RewardFn, tokenizer: Any = None,
                prefix: str = "reward", on_scores: Callable[[TensorDict, torch.Tensor], None] | None = None,
                ) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Score a rollout batch in place: sets ``token_level_scores`` ``[B, T]`` and returns the metrics.

    Reads the non-tensor entries a rollout writes (``response_text``, ``ground_truth``, ``data_source``,
    ``extra_info``; the text is decoded with ``tokenizer`` when absent), ``response_mask``, ``uid`` and
    ``is_padding``.

    Args:
        batch: A rollout batch (see :mod:`verl_trainer.rollout.base`).
        reward_fn: Function, name or ``"module:function"``.
        tokenizer: Only needed when the batch has no ``response_text``.
        prefix: Metric-name prefix (e.g. ``"val/reward"`` for validation).
        on_scores: Called as ``on_scores(batch, scores)`` before the scores are placed on tokens and the
            metrics computed; it may edit both in place (the non-finite check turns samples into padding).

    Returns:
        ``(scores [B], metrics)`` — see :func:`reward_metrics`.

    """
    texts = _response_texts(batch, tokenizer)
    data = non_tensor_lists(batch)
    truths = data.get("ground_truth", [None] * len(texts))
    sources = data.get("data_source", ["unknown"] * len(texts))
    extras = data.get("extra_info")
    scores, info = compute_rewards(texts, truths, sources, reward_fn, extras, return_info=True)
    if on_scores is not None:
        on_scores(batch, scores)
    mask = batch[schema.RESPONSE_MASK] if schema.RESPONSE_MASK in batch.keys() else batch[schema.LOSS_MASK]
    batch[schema.TOKEN_LEVEL_SCORES] = token_level_scores(scores, mask)
    uids = batch[schema.UID] if schema.UID in batch.keys() else None
    return scores, reward_metrics(scores, info, uids, ~schema.real_mask(batch), prefix)
