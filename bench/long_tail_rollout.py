"""The long-tailed workload of ``bench/async_rollout.py``: the hf rollout, with 10% of prompts 8x longer.

:class:`LongTailRollout` is :class:`~verl_trainer.rollout.HFRollout` whose responses are capped at
``max_new_tokens // 8`` tokens, except for the prompts whose token-id hash falls in one bucket of ten
(about 10% of the prompts, the same ones in every run), which may use all ``max_new_tokens``. A tiny random
model seldom samples eos, so the short responses take about ``max_new_tokens // 8`` tokens and the long
ones ``max_new_tokens``: the shape of a reasoning batch where a few prompts generate far longer. Used as
``algorithm.rollout.name=bench/long_tail_rollout.py:LongTailRollout``.

The cap is per *response*, also with partial rollouts, whose chunks are separate calls with ``prompt +
prefix`` as the prompt: each call records its outputs (``prompt + tokens`` -> the response's prompt kind
and tokens so far), so the next chunk of the same response continues with the budget left.

:class:`DiscardingLongTailRollout` is the baseline that admission control replaces: generation stops at a
deadline (the short responses' length) and every response not finished by then (no eos, shorter than its
own cap: the long prompts') is discarded — turned into a padding sample, which trains nothing and counts in
no metric. It exists for the bench only (the trainer never discards a finished or slow sample).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections import defaultdict
from typing import Any

import torch

from verl_trainer.data import schema
from verl_trainer.rollout import HFRollout
from verl_trainer.rollout.config import RolloutConfig

LONG_FRACTION_BUCKETS = 10
STRETCH = 8


def is_long(prompt: list[int]) -> bool:
    """Whether ``prompt`` is one of the ~10% long ones (a stable hash of its ids)."""
    return zlib.crc32(bytes(str(prompt), "utf-8")) % LONG_FRACTION_BUCKETS == 0


class LongTailRollout(HFRollout):
    """HF rollout; short prompts' responses capped at ``max_new_tokens // 8`` (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._continuing: dict[tuple[int, ...], tuple[bool, int]] = {}
        """``prompt + tokens`` of a response in flight -> (its prompt is long, tokens so far)."""
        self._cut: set[tuple[int, ...]] = set()
        """``prompt + response`` of the responses stopped unfinished (the discarding baseline)."""

    def cap(self, long: bool) -> int:
        """A response's token budget over all its calls."""
        total = self.config.max_new_tokens
        return total if long else max(1, total // STRETCH)

    def generate(self, prompt_batch: Any, *args: Any, **kwargs: Any) -> Any:
        """:meth:`HFRollout.generate`; forgets the previous call's responses first."""
        self._continuing.clear()
        self._cut.clear()
        return super().generate(prompt_batch, *args, **kwargs)

    def generate_token_ids(self, prompts: list[list[int]], config: RolloutConfig,
                           seeds: list[int]) -> tuple[list[list[int]], list[list[float]]]:
        """The rows grouped by the budget they have left (one hf call each); results in the prompts' order."""
        state = [self._continuing.get(tuple(p), (is_long(p), 0)) for p in prompts]
        groups: dict[int, list[int]] = defaultdict(list)
        for i, (long, done) in enumerate(state):
            groups[min(config.max_new_tokens, self.cap(long) - done)].append(i)
        ids: list[list[int]] = [[] for _ in prompts]
        log_probs: list[list[float]] = [[] for _ in prompts]
        for budget, rows in groups.items():
            if budget <= 0:
                continue
            got, lps = super().generate_token_ids([prompts[i] for i in rows],
                                                  dataclasses.replace(config, max_new_tokens=budget),
                                                  [seeds[i] for i in rows])
            for i, g, lp in zip(rows, got, lps, strict=True):
                ids[i], log_probs[i] = list(g[:budget]), list(lp[:budget])
        for i, (long, done) in enumerate(state):
            self._continuing[tuple(prompts[i] + ids[i])] = (long, done + len(ids[i]))
            self._record_unfinished(prompts[i], ids[i], long, done)
        return ids, log_probs

    def _record_unfinished(self, prompt: list[int], tokens: list[int], long: bool, done: int) -> None:
        """Nothing here (every response runs to its own cap)."""


class DiscardingLongTailRollout(LongTailRollout):
    """The discarding baseline: a deadline of ``max_new_tokens // 8`` tokens for every response; the ones
    not finished by it are turned into padding samples (module docstring)."""

    def cap(self, long: bool) -> int:
        """Every response stops at the deadline (the short responses' cap)."""
        return max(1, self.config.max_new_tokens // STRETCH)

    def _record_unfinished(self, prompt: list[int], tokens: list[int], long: bool, done: int) -> None:
        ended = bool(tokens) and tokens[-1] in set(self.eos_token_ids)
        if long and not ended and done + len(tokens) < super().cap(long):
            self._cut.add(tuple(prompt + tokens))

    def generate(self, prompt_batch: Any, *args: Any, **kwargs: Any) -> Any:
        """The batch with the unfinished responses discarded (padding samples)."""
        batch = super().generate(prompt_batch, *args, **kwargs)
        ends = (batch[schema.PROMPT_LEN] + batch[schema.RESPONSE_LEN]).tolist()
        cut = torch.tensor([tuple(batch[schema.INPUT_IDS][row, :end].tolist()) in self._cut
                            for row, end in enumerate(ends)], dtype=torch.bool)
        if cut.any():
            schema.mark_padding(batch, cut)
        return batch
