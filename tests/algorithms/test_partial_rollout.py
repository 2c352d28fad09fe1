"""Partial rollouts (``algorithm.rollout.partial_rollout``; ``verl_trainer/algorithms/partial_rollout.py``).

* the chunked sampler in one chunk is the plain call; in several chunks with no weight change its first
  chunk is the plain call's and every token's log-prob is its forward log-prob under those weights;
* a response interrupted after its first chunk by new weights keeps its prefix (the old weights' tokens and
  log-probs), continues under the new weights, and records each token's version; every recorded log-prob
  is the log-prob of its token under the weights its version names (a forward of that model), and a
  replay with the recorded versions gives the same tokens;
* the trainer-level runs (``max_staleness=0`` with partial rollouts = the synchronous run bitwise;
  ``max_staleness=2`` with partial rollouts trains with per-token versions no older than 2 updates) are in
  ``test_async_rollout.py`` (they share its spawns).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from tests.trainer.common import tiny_model

CHUNK, NEW = 3, 12


@pytest.fixture(scope="module")
def rollout_and_weights(tmp_path_factory):
    from verl_trainer.rollout import HFRollout, RolloutConfig

    model = tiny_model(tmp_path_factory.mktemp("partial") / "model")
    rollout = HFRollout(RolloutConfig(n=1, max_new_tokens=NEW, temperature=1.0, device="cpu"), model)
    old = {n: p.detach().clone() for n, p in rollout.model.named_parameters()}
    g = torch.Generator().manual_seed(5)
    new = {n: p + 0.5 * torch.randn(p.shape, generator=g) for n, p in old.items()}
    return rollout, {0: old, 1: new}


def _load(rollout, weights) -> None:
    rollout.update_weights(weights.items())


def _forward_log_probs(rollout, weights, prompt: list[int], response: list[int]) -> torch.Tensor:
    model = copy.deepcopy(rollout.model)
    model.load_state_dict(weights, strict=False)
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response).view(-1, 1)).flatten()


PROMPTS = [[5, 9, 3], [7, 2], [11, 4, 6, 8], [3, 3]]
SEEDS = [101, 202, 303, 404]


def test_chunks_without_new_weights_sample_from_those_weights(rollout_and_weights):
    from verl_trainer.algorithms.partial_rollout import ChunkedSampler
    from verl_trainer.rollout.base import truncate_at_eos

    rollout, weights = rollout_and_weights
    _load(rollout, weights[0])
    whole, whole_lp = rollout.generate_token_ids(PROMPTS, rollout.config, SEEDS)
    whole = [truncate_at_eos(w, rollout.eos_token_ids)[:NEW] for w in whole]
    one = ChunkedSampler(rollout.generate_token_ids, rollout.eos_token_ids, NEW, lambda chunk: 0)
    ids, lps = one(PROMPTS, rollout.config, SEEDS)  # one chunk: the plain call
    assert ids == whole
    for got, want, w in zip(lps, whole_lp, whole, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want[: len(w)]))
    chunked = ChunkedSampler(rollout.generate_token_ids, rollout.eos_token_ids, CHUNK, lambda chunk: 0)
    ids, lps = chunked(PROMPTS, rollout.config, SEEDS)
    assert any(len(t) > CHUNK for t in ids)
    for r, (tokens, lp) in enumerate(zip(ids, lps, strict=True)):
        assert tokens[:CHUNK] == whole[r][:CHUNK] and chunked.versions[r] == [0] * len(tokens)
        want = _forward_log_probs(rollout, weights[0], PROMPTS[r], tokens)
        torch.testing.assert_close(torch.tensor(lp), want, atol=2e-5, rtol=1e-4)


def test_interrupted_response_continues_under_new_weights(rollout_and_weights):
    from verl_trainer.algorithms.partial_rollout import ChunkedSampler, chunk_seed
    from verl_trainer.rollout.base import truncate_at_eos

    rollout, weights = rollout_and_weights

    def update_after_first_chunk(chunk: int) -> int:
        version = 0 if chunk == 0 else 1
        _load(rollout, weights[version])
        return version

    sampler = ChunkedSampler(rollout.generate_token_ids, rollout.eos_token_ids, CHUNK,
                             update_after_first_chunk)
    ids, lps = sampler(PROMPTS, rollout.config, SEEDS)
    versions = sampler.versions
    _load(rollout, weights[0])
    first, _ = rollout.generate_token_ids(PROMPTS, rollout.config, SEEDS)  # old weights, uninterrupted
    switched = 0
    for r, (tokens, lp, ver) in enumerate(zip(ids, lps, versions, strict=True)):
        assert len(tokens) == len(lp) == len(ver) <= NEW
        assert ver == [0] * min(CHUNK, len(tokens)) + [1] * max(0, len(tokens) - CHUNK)
        assert tokens[:CHUNK] == truncate_at_eos(first[r], rollout.eos_token_ids)[:CHUNK]  # the prefix kept
        for version in (0, 1):  # each token's log-prob is its sampling weights' (the behaviour policy)
            rows = [i for i, v in enumerate(ver) if v == version]
            if rows:
                want = _forward_log_probs(rollout, weights[version], PROMPTS[r], tokens)[rows]
                torch.testing.assert_close(torch.tensor(lp)[rows], want, atol=2e-5, rtol=1e-4)
        switched += int(1 in ver)
        if len(tokens) > CHUNK:  # the continuation is the new weights' sample from prompt + prefix
            _load(rollout, weights[1])
            config = dataclasses.replace(rollout.config, max_new_tokens=CHUNK)
            seed = [chunk_seed(SEEDS[r], 1)]
            rest, _ = rollout.generate_token_ids([PROMPTS[r] + tokens[:CHUNK]], config, seed)
            assert tokens[CHUNK: 2 * CHUNK] == truncate_at_eos(rest[0], rollout.eos_token_ids)[:CHUNK]
    assert switched >= 2  # the check saw real interruptions
    replay = ChunkedSampler(rollout.generate_token_ids, rollout.eos_token_ids, CHUNK,
                            update_after_first_chunk)
    assert replay(PROMPTS, rollout.config, SEEDS)[0] == ids and replay.versions == versions


def test_partial_chunk_tokens_is_checked():
    from verl_trainer.rollout import RolloutConfig

    with pytest.raises(ValueError, match="partial_chunk_tokens=0 must be >= 1"):
        RolloutConfig(partial_chunk_tokens=0)
