"""The long-tailed workload of ``bench/async_rollout.py``: the hf rollout, with 10% of prompts 8x longer.

:class:`LongTailRollout` is :class:`~verl_trainer.rollout.HFRollout` whose responses are capped at
``max_new_tokens // 8`` tokens, except for the prompts whose token-id hash falls in one bucket of ten
(about 10% of the prompts, the same ones in every run), which may use all ``max_new_tokens``. A tiny random
model seldom samples eos, so the short responses take about ``max_new_tokens // 8`` tokens and the long
ones ``max_new_tokens``: the shape of a reasoning batch where a few prompts generate far longer. Used as
``algorithm.rollout.name=bench/long_tail_rollout.py:LongTailRollout``.
"""

from __future__ import annotations

import dataclasses
import zlib

from verl_trainer.rollout import HFRollout
from verl_trainer.rollout.config import RolloutConfig

LONG_FRACTION_BUCKETS = 10
STRETCH = 8


def is_long(prompt: list[int]) -> bool:
    """Whether ``prompt`` is one of the ~10% long ones (a stable hash of its ids)."""
    return zlib.crc32(bytes(str(prompt), "utf-8")) % LONG_FRACTION_BUCKETS == 0


class LongTailRollout(HFRollout):
    """HF rollout; short prompts capped at ``max_new_tokens // 8`` (see the module docstring)."""

    def generate_token_ids(self, prompts: list[list[int]], config: RolloutConfig,
                           seeds: list[int]) -> tuple[list[list[int]], list[list[float]]]:
        """Long and short prompts in two calls of the hf loop; results in the prompts' order.

        Raises:
            ValueError: With ``partial_rollout``: the cap applies per call, and partial rollouts split a
                response over several calls (each would be capped again), so the workload would not be the
                same.
        """
        if self.config.partial_rollout:
            raise ValueError("the long_tail workload caps each generate call, so it cannot run with "
                             "algorithm.rollout.partial_rollout=true (chunked calls); use the realistic "
                             "workload")
        short_cfg = dataclasses.replace(config, max_new_tokens=max(1, config.max_new_tokens // STRETCH))
        ids: list[list[int]] = [[] for _ in prompts]
        log_probs: list[list[float]] = [[] for _ in prompts]
        for long in (True, False):
            rows = [i for i, p in enumerate(prompts) if is_long(p) == long]
            if not rows:
                continue
            got, lps = super().generate_token_ids([prompts[i] for i in rows], config if long else short_cfg,
                                                  [seeds[i] for i in rows])
            for i, g, lp in zip(rows, got, lps, strict=True):
                ids[i], log_probs[i] = g, lp
        return ids, log_probs
