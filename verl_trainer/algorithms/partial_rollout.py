"""Partial rollouts (``algorithm.rollout.partial_rollout``): chunked generation, newer weights between chunks.

With the asynchronous rollout (:mod:`verl_trainer.algorithms.async_rollout`) a group of step ``s`` is
admitted with the weights of an older step. With partial rollouts its responses are generated
``partial_chunk_tokens`` tokens at a time; before each chunk the thread loads the newest published weights
that step ``s`` may use (version ``<= s``), so an in-flight generation stops at a weight update, keeps its
prefix tokens and their behaviour log-probs, and continues under the new weights: the next chunk is
sampled from ``prompt + prefix`` (the backend recomputes the prefix's KV cache under the new weights).

Sampling of chunk ``j`` of response ``r`` is seeded by :func:`chunk_seed` ``(seeds[r], j)`` (chunk 0:
``seeds[r]`` itself), so given the version of each chunk the tokens are determined: a replay with the
recorded versions gives the same tokens. Which chunk sees a newer version depends on when the update
lands (timing), so a run with partial rollouts is not reproducible step for step, unlike one without.

The batch carries the per-token behaviour log-probs (``rollout_log_probs``, each token's from the weights
that drew it) and ``token_policy_version``; the loss is the decoupled objective already built: the PPO
ratio against ``old_log_probs`` (the proximal policy: the trainer's forward before the update) and the
behaviour/proximal ratio through ``rollout_correction`` (truncated or masked importance sampling).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict

from verl_trainer.data import schema
from verl_trainer.rollout.base import derive_sample_seed, truncate_at_eos

if TYPE_CHECKING:
    from verl_trainer.rollout.config import RolloutConfig

__all__ = ["ChunkedSampler", "chunk_seed", "place_token_versions"]

TokenIds = Callable[[list[list[int]], "RolloutConfig", list[int]], tuple[list[list[int]], list[list[float]]]]
_CHUNK_STREAM = 2


def chunk_seed(seed: int, chunk: int) -> int:
    """The seed of chunk ``chunk`` of a response seeded ``seed`` (chunk 0: ``seed`` itself)."""
    return int(seed) if chunk == 0 else derive_sample_seed(seed, chunk, 0, 0, stream=_CHUNK_STREAM)


class ChunkedSampler:
    """A ``generate_token_ids`` that samples ``chunk_tokens`` tokens at a time (see the module docstring).

    Args:
        generate: The backend's ``generate_token_ids(prompts, config, seeds)``.
        eos_token_ids: Ids that end a response.
        chunk_tokens: Tokens per chunk (``>= 1``).
        before_chunk: Called with the chunk index before each chunk; may load newer weights; returns the
            version the chunk samples with.

    After a call, :attr:`versions` holds, per response, the version of each returned token.
    """

    def __init__(self, generate: TokenIds, eos_token_ids: Iterable[int], chunk_tokens: int,
                 before_chunk: Callable[[int], int]) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"ChunkedSampler chunk_tokens={chunk_tokens} must be >= 1")
        self.generate = generate
        self.eos = set(eos_token_ids)
        self.chunk_tokens = chunk_tokens
        self.before_chunk = before_chunk
        self.versions: list[list[int]] = []

    def __call__(self, prompts: list[list[int]], config: RolloutConfig,
                 seeds: list[int]) -> tuple[list[list[int]], list[list[float]]]:
        """``(ids, log_probs)`` as ``generate_token_ids`` gives them; eos-cut, ``<= max_new_tokens`` each."""
        total = config.max_new_tokens
        ids: list[list[int]] = [[] for _ in prompts]
        log_probs: list[list[float]] = [[] for _ in prompts]
        versions: list[list[int]] = [[] for _ in prompts]
        active, chunk = list(range(len(prompts))), 0
        while active:
            version = self.before_chunk(chunk)
            budget = min(self.chunk_tokens, total - chunk * self.chunk_tokens)
            got, lps = self.generate([prompts[r] + ids[r] for r in active],
                                     dataclasses.replace(config, max_new_tokens=budget),
                                     [chunk_seed(seeds[r], chunk) for r in active])
            still = []
            for r, tokens, lp in zip(active, got, lps, strict=True):
                tokens = truncate_at_eos(tokens, self.eos)[:budget]
                ids[r] += tokens
                log_probs[r] += list(lp[: len(tokens)])
                versions[r] += [version] * len(tokens)
                ended = not tokens or tokens[-1] in self.eos or len(tokens) < budget
                if not ended and len(ids[r]) < total:
                    still.append(r)
            active, chunk = still, chunk + 1
        self.versions = versions
        return ids, log_probs


def place_token_versions(batch: TensorDict, versions: list[list[int]]) -> torch.Tensor:
    """``[B, T]`` int64: each response token's version at its position (``prompt_len ..``), else ``-1``.

    Raises:
        RuntimeError: A row's version count differs from its ``response_len``.
    """
    out = torch.full(batch[schema.INPUT_IDS].shape, -1, dtype=torch.long)
    for row, (start, values) in enumerate(zip(batch[schema.PROMPT_LEN].tolist(), versions, strict=True)):
        length = int(batch[schema.RESPONSE_LEN][row])
        if len(values) < length:
            raise RuntimeError(f"response {row}: {len(values)} token versions for {length} tokens")
        out[row, start: start + length] = torch.tensor(values[:length], dtype=torch.long)
    return out
