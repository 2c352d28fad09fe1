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
from verl_trainer.rewards.signature import TRL, reward_style

ACCURACY_KEY = "acc"
"""A reward function's per-sample correctness entry; logged as ``{prefix}/accuracy``."""


def _accepts_extra_info(fn: RewardFn) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return "extra_info" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _accepted(fn: RewardFn, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` limited to what ``fn`` takes (all of them when it has ``**kwargs``)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _display_name(spec: str | RewardFn) -> str:
    if isinstance(spec, str):
        return spec.rpartition(":")[2] or spec
    return getattr(spec, "__name__", type(spec).__name__)


class RewardFunctions:
    """One or more reward functions (verl's or TRL's signature) and their weights.

    A sample's score is the weighted sum of the functions' scores (TRL's ``reward_weights``; a TRL
    function's ``None`` counts 0). With several functions each one's mean is logged as
    ``reward/<name>/mean``.

    Args:
        functions: A function, a name / ``"module:function"`` / ``"file.py:function"``, or a list of them.
        weights: One weight per function (default 1.0 each).

    Raises:
        ValueError: No function, an unknown one, one with neither signature, or weights that do not match.
    """

    def __init__(self, functions: str | RewardFn | Sequence[str | RewardFn],
                 weights: Sequence[float] | None = None) -> None:
        specs = [functions] if isinstance(functions, str) or callable(functions) else list(functions)
        if not specs:
            raise ValueError("reward: give at least one reward function (algorithm.reward.name)")
        self.functions = [get_reward_fn(spec) for spec in specs]
        names = [_display_name(spec) for spec in specs]
        self.names = [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]
        self.styles = [reward_style(fn, name) for fn, name in zip(self.functions, self.names)]
        if weights is None:
            weights = [1.0] * len(specs)
        if len(weights) != len(specs):
            raise ValueError(f"reward: {len(weights)} weights {list(weights)} for {len(specs)} functions "
                             f"{self.names}; give one weight per function")
        self.weights = [float(w) for w in weights]

    def __len__(self) -> int:
        return len(self.functions)

    def _call_verl(self, fn: RewardFn, texts: Sequence[str], truths: Sequence[Any], sources: Sequence[str],
                   extras: Sequence[Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        b = len(texts)
        pass_extra = _accepts_extra_info(fn)
        scores = torch.zeros(b, dtype=torch.float32)
        info: dict[str, torch.Tensor] = {}
        for i in range(b):
            kwargs = {"extra_info": extras[i]} if pass_extra else {}
            result = fn(sources[i], texts[i], truths[i], **kwargs)
            if isinstance(result, Mapping):
                if "score" not in result:
                    raise ValueError(
                        f"reward function {fn!r} returned a dict without 'score': {dict(result)}"
                    )
                for key, value in result.items():
                    if key != "score" and isinstance(value, (int, float, bool)):
                        info.setdefault(key, torch.zeros(b, dtype=torch.float32))[i] = float(value)
                result = result["score"]
            scores[i] = float(result)
        return scores, info

    @staticmethod
    def _call_trl(fn: RewardFn, name: str, texts: Sequence[str], truths: Sequence[Any],
                  sources: Sequence[str], extras: Sequence[Any], columns: Sequence[Mapping[str, Any]]
                  ) -> torch.Tensor:
        b = len(texts)
        prompts = [c.get("prompt") for c in columns]
        chat = any(isinstance(p, list) for p in prompts)
        completions: list[Any] = (
            [[{"role": "assistant", "content": t}] for t in texts] if chat else list(texts)
        )
        kwargs: dict[str, Any] = {"ground_truth": list(truths), "data_source": list(sources),
                                  "extra_info": list(extras)}
        for key in sorted({k for c in columns for k in c} - {"prompt"} - set(kwargs)):
            kwargs[key] = [c.get(key) for c in columns]
        kwargs = {"prompts": prompts, "completions": completions, **kwargs}
        required = [n for n, p in inspect.signature(fn).parameters.items()
                    if p.default is inspect.Parameter.empty
                    and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
        missing = [n for n in required if n not in kwargs]
        if missing:
            raise ValueError(f"reward function {name} needs the columns {missing}, which the prompt file "
                             f"does not have; it has {sorted(kwargs)}")
        out = fn(**_accepted(fn, kwargs))
        values = list(out.tolist() if isinstance(out, torch.Tensor) else out)
        if len(values) != b or not all(v is None or isinstance(v, (int, float, bool)) for v in values):
            raise ValueError(f"reward function {name} (TRL signature) must return {b} numbers or None, one "
                             f"per completion; got {type(out).__name__} {values[:4]!r}...")
        return torch.tensor([float("nan") if v is None else float(v) for v in values], dtype=torch.float32)

    def __call__(self, texts: Sequence[str], ground_truths: Sequence[Any], data_sources: Sequence[str],
                 extra_infos: Sequence[Any] | None = None, columns: Sequence[Mapping[str, Any]] | None = None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Score ``B`` responses: ``(scores [B], info)``, ``info[key]`` ``[B]`` per extra value.

        A single function's dict results report their other numbers under their own keys (``acc``); with
        several functions every key is prefixed with the function's name, and each function's scores
        are under ``<name>/mean`` (NaN where a TRL function returned ``None``).
        """
        b = len(texts)
        extras = list(extra_infos) if extra_infos is not None else [None] * b
        cols = list(columns) if columns is not None else [{} for _ in range(b)]
        total = torch.zeros(b, dtype=torch.float32)
        info: dict[str, torch.Tensor] = {}
        for fn, name, style, weight in zip(self.functions, self.names, self.styles, self.weights):
            if style == TRL:
                scores, own = self._call_trl(fn, name, texts, ground_truths, data_sources, extras, cols), {}
            else:
                scores, own = self._call_verl(fn, texts, ground_truths, data_sources, extras)
            total += weight * torch.nan_to_num(scores, nan=0.0)
            if len(self) == 1:
                info.update(own)
            else:
                info.update({f"{name}/{key}": value for key, value in own.items()})
                info[f"{name}/mean"] = scores
        return total, info


def compute_rewards(
    texts: Sequence[str],
    ground_truths: Sequence[Any],
    data_sources: Sequence[str],
    reward_fn: str | RewardFn | RewardFunctions,
    extra_infos: Sequence[Mapping[str, Any] | None] | None = None,
    return_info: bool = False,
    columns: Sequence[Mapping[str, Any]] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Score every response with rule-based reward functions.

    Args:
        texts: ``B`` decoded responses.
        ground_truths: ``B`` ground truths.
        data_sources: ``B`` data-source names.
        reward_fn: A function (verl's or TRL's signature), a name / ``"module:function"`` for
            :func:`verl_trainer.rewards.get_reward_fn`, or :class:`RewardFunctions`.
        extra_infos: ``B`` dicts passed as ``extra_info`` (when the function accepts it).
        return_info: Also return the other numeric entries (see :meth:`RewardFunctions.__call__`).
        columns: ``B`` dicts: the prompt as written and the prompt file's other columns (TRL functions).

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
    functions = reward_fn if isinstance(reward_fn, RewardFunctions) else RewardFunctions(reward_fn)
    scores, info = functions(texts, ground_truths, data_sources, extra_infos, columns)
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
        v = v[~v.isnan()]  # a TRL function's None: not part of its mean
        name = "accuracy" if key == ACCURACY_KEY else key
        mean = v.mean() if v.numel() else torch.zeros(())
        metrics[f"{prefix}/{name}"] = Metric.mean(mean, weight=v.numel())
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


def score_batch(batch: TensorDict, reward_fn: str | RewardFn | RewardFunctions, tokenizer: Any = None,
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
    scores, info = compute_rewards(texts, truths, sources, reward_fn, extras, return_info=True,
                                   columns=data.get("columns"))
    if on_scores is not None:
        on_scores(batch, scores)
    mask = batch[schema.RESPONSE_MASK] if schema.RESPONSE_MASK in batch.keys() else batch[schema.LOSS_MASK]
    batch[schema.TOKEN_LEVEL_SCORES] = token_level_scores(scores, mask)
    uids = batch[schema.UID] if schema.UID in batch.keys() else None
    return scores, reward_metrics(scores, info, uids, ~schema.real_mask(batch), prefix)
