"""Scoring a batch: reward function over the samples, scores placed on tokens, reward metrics.

Outcome rewards are one scalar per sample. :func:`token_level_scores` puts it on the **last response
token** of the sample (the eos when the response stopped), the position verl uses, so that summing
``token_level_scores`` over the response gives the scalar back and GRPO/RLOO/GAE read it there.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from verl_trainer.data import schema
from verl_trainer.data.schema import non_tensor_lists
from verl_trainer.metrics import Metric, sample_stats
from verl_trainer.rewards.failures import (
    DEFAULT_TIMEOUT_S,
    RewardError,
    RewardFailure,
    check_on_error,
    check_timeout,
    describe_failures,
    policy_hint,
)
from verl_trainer.rewards.registry import RewardFn, get_reward_fn
from verl_trainer.rewards.results import RewardReturnError, as_number, as_score, check_trl_output, returned
from verl_trainer.rewards.signature import TRL, reward_style
from verl_trainer.utils.daemon_calls import AbandonedCallError, DaemonCalls

ACCURACY_KEY = "acc"
"""A reward function's per-sample correctness entry; logged as ``{prefix}/accuracy``."""
FAILED_KEY = "_failed"
TIMED_OUT_KEY = "_timed_out"
"""``info`` entries ``[B]`` (1 where a reward call failed / timed out); counted, not averaged, in metrics."""

COMPLETION_MESSAGES = "_completion_messages"
"""Column :func:`score_batch` sets in a multi-turn batch: each trajectory's messages after the prompt
(``assistant`` turns with their ``tool_calls``, ``tool`` results, an environment's ``user`` replies), which
TRL-style functions get as ``completions[i]`` (TRL's multi-turn shape: ``completion[-1]["content"]`` is the
final answer). Not passed as a keyword argument itself."""


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

    A call that raises, times out or returns a non-number is a failure (:mod:`verl_trainer.rewards.failures`):
    it scores 0, is recorded in :attr:`failures` and marked in ``info`` (:data:`FAILED_KEY`,
    :data:`TIMED_OUT_KEY`); :func:`compute_rewards` raises for it under ``on_error="error"``.

    **Time limit.** With ``timeout_s`` set, every call (one sample of a verl-style function, the whole batch
    of a TRL-style one) runs on a daemon worker thread (:class:`~verl_trainer.utils.daemon_calls.DaemonCalls`)
    and is waited for at most ``timeout_s`` seconds; a call past it is a time-out failure (its thread is
    abandoned: a user function cannot be moved to a killable process, see that module for the bound on
    the threads left running). Off the calling thread, a function's own ``signal.alarm`` limits cannot work
    (``math_verify``'s ``parsing_timeout`` / ``timeout_seconds``: set them to ``None``). ``timeout_s=None``
    calls on the calling thread with no limit.

    Args:
        functions: A function, a name / ``"module:function"`` / ``"file.py:function"``, or a list of them.
        weights: One weight per function (default 1.0 each).
        on_error: ``error`` | ``drop`` | ``zero`` (see :mod:`verl_trainer.rewards.failures`).
        timeout_s: The longest one call may take (``algorithm.reward.timeout_s``); ``None``: no limit.

    Raises:
        ValueError: No function, an unknown one, one with neither signature, weights that do not match, an
            unknown ``on_error`` or a ``timeout_s`` that is not a number > 0 or ``None``.
    """

    def __init__(self, functions: str | RewardFn | Sequence[str | RewardFn],
                 weights: Sequence[float] | None = None, on_error: str = "error",
                 timeout_s: float | None = DEFAULT_TIMEOUT_S) -> None:
        check_on_error(on_error)
        check_timeout(timeout_s)
        self.on_error = on_error
        self.timeout_s = timeout_s
        self._threads = DaemonCalls("reward") if timeout_s is not None else None
        self.failures: list[RewardFailure] = []
        """The failed calls of the last :meth:`__call__`."""
        specs = [functions] if isinstance(functions, str) or callable(functions) else list(functions)
        if not specs:
            raise ValueError("reward: give at least one reward function (algorithm.reward.name)")
        self.functions = [get_reward_fn(spec) for spec in specs]
        names = [_display_name(spec) for spec in specs]
        self.names = [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]
        self.styles = [reward_style(fn, name) for fn, name in zip(self.functions, self.names)]
        self.takes_trl_kwargs = TRL in self.styles
        """Whether a TRL-style function is among them (only those get ``trainer_state`` / ``log_metric``)."""
        if weights is None:
            weights = [1.0] * len(specs)
        if len(weights) != len(specs):
            raise ValueError(f"reward: {len(weights)} weights {list(weights)} for {len(specs)} functions "
                             f"{self.names}; give one weight per function")
        self.weights = [float(w) for w in weights]

    def __len__(self) -> int:
        return len(self.functions)

    def check_data_sources(self, sources: Iterable[str]) -> None:
        """Before any model loads: each function that declares ``fn.check_data_sources`` checks ``sources``.

        Raises:
            ValueError: A function cannot score one of them (e.g.
                :func:`~verl_trainer.rewards.default_compute_score` and an unknown data source).
        """
        sources = sorted({str(s) for s in sources})
        for fn in self.functions:
            check = getattr(fn, "check_data_sources", None)
            if callable(check):
                check(sources)

    def _invoke(self, fn: RewardFn, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` under :attr:`timeout_s` (raises ``AbandonedCallError`` past it)."""
        if self._threads is None:
            return fn(*args, **kwargs)
        return self._threads.run(fn, *args, timeout_s=self.timeout_s, **kwargs)

    def _fail(self, name: str, i: int, sources: Sequence[str], texts: Sequence[str],
              exc: BaseException | None, message: str = "") -> None:
        text = message or f"{type(exc).__name__}: {exc}"
        if isinstance(exc, AbandonedCallError):
            text += f" (algorithm.reward.timeout_s={self.timeout_s:g}; raise it for a slow function)"
        elif isinstance(exc, ValueError) and "main thread" in str(exc) and self._threads is not None:
            text = ("it uses signal-based time-outs, which work on the main thread only, and runs on a "
                    "worker thread under algorithm.reward.timeout_s: pass parsing_timeout=None / "
                    "timeout_seconds=None to math_verify, or set algorithm.reward.timeout_s=null")
        timeout = isinstance(exc, TimeoutError)
        self.failures.append(RewardFailure(name, i, str(sources[i]), str(texts[i]), timeout, text))

    def _call_verl(self, fn: RewardFn, name: str, texts: Sequence[str], truths: Sequence[Any],
                   sources: Sequence[str], extras: Sequence[Any]
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        b = len(texts)
        pass_extra = _accepts_extra_info(fn)
        scores = torch.zeros(b, dtype=torch.float32)
        info: dict[str, torch.Tensor] = {}
        for i in range(b):
            kwargs = {"extra_info": extras[i]} if pass_extra else {}
            try:
                result = self._invoke(fn, sources[i], texts[i], truths[i], **kwargs)
            except Exception as exc:  # noqa: BLE001  (counted and handled by on_error)
                self._fail(name, i, sources, texts, exc)
                continue
            if isinstance(result, Mapping):
                if "score" not in result:
                    missing = f"returned a dict without 'score': {dict(result)}"
                    self._fail(name, i, sources, texts, None, missing)
                    continue
                for key, value in result.items():
                    if key != "score" and isinstance(value, (int, float, bool)):
                        info.setdefault(key, torch.zeros(b, dtype=torch.float32))[i] = float(value)
                key, result = "score", result["score"]
            else:
                key = None
            if isinstance(result, (int, float)):  # the usual return (bool included): no conversion to check
                scores[i] = float(result)
                continue
            try:
                scores[i] = as_score(result, key=key)
            except RewardReturnError as exc:
                self._fail(name, i, sources, texts, None, str(exc))
        return scores, info

    def _call_trl(self, fn: RewardFn, name: str, texts: Sequence[str], truths: Sequence[Any],
                  sources: Sequence[str], extras: Sequence[Any], columns: Sequence[Mapping[str, Any]],
                  shared: Mapping[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        b = len(texts)
        prompts = [c.get("prompt") for c in columns]
        chat = any(isinstance(p, list) for p in prompts)
        conversations = [c.get(COMPLETION_MESSAGES) for c in columns]
        completions: list[Any]
        if any(m is not None for m in conversations):  # multi-turn: assistant and tool turns apart (TRL)
            completions = [[dict(m) for m in ms] if ms is not None else [{"role": "assistant", "content": t}]
                           for ms, t in zip(conversations, texts)]
        else:
            completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else list(texts)
        kwargs: dict[str, Any] = {"ground_truth": list(truths), "data_source": list(sources),
                                  "extra_info": list(extras)}
        for key in sorted({k for c in columns for k in c} - {"prompt", COMPLETION_MESSAGES} - set(kwargs)):
            kwargs[key] = [c.get(key) for c in columns]
        kwargs = {"prompts": prompts, "completions": completions, **kwargs, **(shared or {})}
        required = [n for n, p in inspect.signature(fn).parameters.items()
                    if p.default is inspect.Parameter.empty
                    and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
        missing = [n for n in required if n not in kwargs]
        if missing:
            raise ValueError(f"reward function {name} needs the columns {missing}, which the prompt file "
                             f"does not have; it has {sorted(kwargs)}")
        try:
            out = self._invoke(fn, **_accepted(fn, kwargs))
        except Exception as exc:  # noqa: BLE001  (every sample of the call failed)
            for i in range(b):
                self._fail(name, i, sources, texts, exc)
            return torch.zeros(b, dtype=torch.float32), torch.zeros(b, dtype=torch.bool)
        values: list[Any] = check_trl_output(out, name, b)
        for i, v in enumerate(values):
            number = None if v is None else as_number(v)
            if v is not None and number is None:
                self._fail(name, i, sources, texts, None,
                           f"returned {returned(v)}; each entry must be a number or None")
                number = 0.0
            values[i] = number
        none = torch.tensor([v is None for v in values], dtype=torch.bool)
        scores = torch.tensor([0.0 if v is None else float(v) for v in values], dtype=torch.float32)
        return scores, none

    def __call__(self, texts: Sequence[str], ground_truths: Sequence[Any], data_sources: Sequence[str],
                 extra_infos: Sequence[Any] | None = None, columns: Sequence[Mapping[str, Any]] | None = None,
                 trl_kwargs: Mapping[str, Any] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Score ``B`` responses: ``(scores [B], info)``, ``info[key]`` ``[B]`` per extra value.

        ``trl_kwargs`` are passed as they are (not per sample) to TRL-style functions that accept them
        (TRL's ``trainer_state``, ``log_metric``).

        A single function's dict results report their other numbers under their own keys (``acc``); with
        several functions every key is prefixed with the function's name, and each function's scores
        are under ``<name>/mean`` (NaN where a TRL function returned ``None``).
        """
        b = len(texts)
        extras = list(extra_infos) if extra_infos is not None else [None] * b
        cols = list(columns) if columns is not None else [{} for _ in range(b)]
        total = torch.zeros(b, dtype=torch.float32)
        info: dict[str, torch.Tensor] = {}
        self.failures = []
        for fn, name, style, weight in zip(self.functions, self.names, self.styles, self.weights):
            if style == TRL:
                (scores, none), own = self._call_trl(fn, name, texts, ground_truths, data_sources, extras,
                                                     cols, trl_kwargs), {}
            else:
                scores, own = self._call_verl(fn, name, texts, ground_truths, data_sources, extras)
                none = None
            # The raw scores are added as they are: a NaN or inf stays non-finite in the total, where the
            # non-finite guard sees it (algorithm.non_finite). Only a TRL ``None`` (the function does not
            # apply to that sample) counts 0, by its own mask.
            total += weight * scores
            if len(self) == 1:
                info.update(own)
            else:
                info.update({f"{name}/{key}": value for key, value in own.items()})
                info[f"{name}/mean"] = scores if none is None else scores.masked_fill(none, float("nan"))
        failed, timed_out = torch.zeros(b), torch.zeros(b)
        for f in self.failures:
            (timed_out if f.timeout else failed)[f.index] = 1.0
        info[FAILED_KEY], info[TIMED_OUT_KEY] = torch.maximum(failed, timed_out), timed_out
        return total, info

    def raise_failures(self, where: str = "") -> None:
        """Under ``on_error="error"``: :class:`RewardError` naming the failed calls of the last call."""
        if self.failures and self.on_error == "error":
            listed = describe_failures([f.describe(where) for f in self.failures], len(self.failures))
            raise RewardError(f"{len(self.failures)} reward call(s) failed: {listed}; {policy_hint()}")


def compute_rewards(
    texts: Sequence[str],
    ground_truths: Sequence[Any],
    data_sources: Sequence[str],
    reward_fn: str | RewardFn | RewardFunctions,
    extra_infos: Sequence[Mapping[str, Any] | None] | None = None,
    return_info: bool = False,
    columns: Sequence[Mapping[str, Any]] | None = None,
    raise_on_error: bool = True,
    trl_kwargs: Mapping[str, Any] | None = None,
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
        raise_on_error: Raise :class:`~verl_trainer.rewards.failures.RewardError` for failed calls under
            ``on_error="error"`` (``False``: the caller does, e.g. on every rank together).
        trl_kwargs: Keyword arguments for TRL-style functions, the same for every sample (``trainer_state``,
            ``log_metric``).

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
    scores, info = functions(texts, ground_truths, data_sources, extra_infos, columns, trl_kwargs)
    if raise_on_error:
        functions.raise_failures()
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
    metrics = sample_stats(values, prefix)
    for key, per_sample in (info or {}).items():
        if key.startswith("_"):  # failure marks: counted over ranks by the caller, not averaged
            continue
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


def _response_texts(batch: TensorDict, data: dict[str, list[Any]], tokenizer: Any) -> list[str]:
    """The batch's ``response_text`` (read into ``data``, taken out of it), else the decoded responses."""
    if "response_text" in data:
        return data.pop("response_text")
    if tokenizer is None:
        raise ValueError("the batch has no 'response_text'; pass the tokenizer to decode the responses")
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in _completion_ids(batch)]


def _completion_ids(batch: TensorDict) -> list[list[int]]:
    """Each row's response token ids (TRL's ``completion_ids``)."""
    ids, start, length = batch[schema.INPUT_IDS], batch[schema.PROMPT_LEN], batch[schema.RESPONSE_LEN]
    return [ids[i, s: s + n].tolist() for i, (s, n) in enumerate(zip(start.tolist(), length.tolist()))]


@dataclass
class BatchScores:
    """The scores of a rollout batch (:func:`score_batch`, :func:`place_scores`).

    Unpacks as ``scores, metrics = score_batch(...)``.
    """

    scores: torch.Tensor
    """``[B]`` float32, a dropped sample's 0."""
    metrics: dict[str, Metric]
    """:func:`reward_metrics` of the real samples."""
    info: dict[str, torch.Tensor] = field(default_factory=dict)
    """The reward's other per-sample values, ``[B]`` each (``acc``; the failure marks)."""

    def __iter__(self) -> Iterator[Any]:
        yield self.scores
        yield self.metrics


def score_responses(batch: TensorDict, reward_fn: str | RewardFn | RewardFunctions, tokenizer: Any = None,
                    raise_on_error: bool = True, trl_kwargs: Mapping[str, Any] | None = None
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The reward functions' ``(scores [B], info)`` of a rollout batch; the batch is not changed.

    Reads the non-tensor entries a rollout writes (``response_text``, ``ground_truth``, ``data_source``,
    ``extra_info``, ``columns``; the text is decoded with ``tokenizer`` when absent).

    Args:
        batch: A rollout batch (see :mod:`verl_trainer.rollout.base`).
        reward_fn: Function, name or ``"module:function"``, or :class:`RewardFunctions`.
        tokenizer: Only needed when the batch has no ``response_text``.
        raise_on_error: See :func:`compute_rewards`.
        trl_kwargs: See :func:`compute_rewards`. TRL-style functions also get ``completion_ids`` (TRL's
            name): each response's token ids, a list of ints per sample. In a multi-turn batch their
            ``completions[i]`` is the trajectory's message list (see :data:`COMPLETION_MESSAGES`).

    Returns:
        ``(scores, info)`` as :func:`compute_rewards` with ``return_info=True``.
    """
    data = non_tensor_lists(batch, (*schema.NON_TENSOR_KEYS, "response_text"))  # one read of them all
    texts = _response_texts(batch, data, tokenizer)
    truths = data.get("ground_truth", [None] * len(texts))
    sources = data.get("data_source", ["unknown"] * len(texts))
    extras = data.get("extra_info")
    columns = data.get("columns") or [{} for _ in texts]
    columns = [{**c, "completion_ids": ids} for c, ids in zip(columns, _completion_ids(batch))]
    if "agent_info" in batch.keys():  # multi-turn (rollout.base.AGENT_INFO): the conversation, turn by turn
        infos = batch["agent_info"]
        columns = [{**c, COMPLETION_MESSAGES: info["messages"]} for c, info in zip(columns, infos)]
    return compute_rewards(texts, truths, sources, reward_fn, extras, return_info=True, columns=columns,
                           raise_on_error=raise_on_error, trl_kwargs=trl_kwargs)


def place_scores(batch: TensorDict, scores: torch.Tensor, info: dict[str, torch.Tensor],
                 prefix: str = "reward") -> BatchScores:
    """Set ``token_level_scores`` ``[B, T]`` in ``batch`` and take the reward metrics of its real samples.

    Call it after any check that turns samples into padding (their scores 0): padding is left out of the
    metrics. Reads ``response_mask`` (else ``loss_mask``), ``uid`` and ``is_padding``.
    """
    mask = batch[schema.RESPONSE_MASK] if schema.RESPONSE_MASK in batch.keys() else batch[schema.LOSS_MASK]
    batch[schema.TOKEN_LEVEL_SCORES] = token_level_scores(scores, mask)
    uids = batch[schema.UID] if schema.UID in batch.keys() else None
    return BatchScores(scores, reward_metrics(scores, info, uids, ~schema.real_mask(batch), prefix), info)


def score_batch(batch: TensorDict, reward_fn: str | RewardFn | RewardFunctions, tokenizer: Any = None,
                prefix: str = "reward", raise_on_error: bool = True,
                trl_kwargs: Mapping[str, Any] | None = None) -> BatchScores:
    """Score a rollout batch in place: :func:`score_responses`, then :func:`place_scores`.

    Args:
        batch: A rollout batch (see :mod:`verl_trainer.rollout.base`); ``token_level_scores`` is set.
        reward_fn: Function, name or ``"module:function"``, or :class:`RewardFunctions`.
        tokenizer: Only needed when the batch has no ``response_text``.
        prefix: Metric-name prefix (e.g. ``"val/reward"`` for validation).
        raise_on_error: See :func:`compute_rewards`.
        trl_kwargs: See :func:`score_responses`.

    Returns:
        :class:`BatchScores` (``scores, metrics = score_batch(...)`` unpacks it); the metrics are
        :func:`reward_metrics`'.
    """
    scores, info = score_responses(batch, reward_fn, tokenizer, raise_on_error, trl_kwargs)
    return place_scores(batch, scores, info, prefix)
