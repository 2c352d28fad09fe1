"""The rollout interface: prompt batch in, schema batch of sampled responses out; weights synced in.

A backend implements two things: :meth:`BaseRollout.generate_token_ids` (prompt id lists -> response id
lists, sampled with a given config and seed) and :meth:`BaseRollout.update_weights`. Everything else —
repeating each prompt ``n`` times, cutting responses at the first eos, building the schema batch and
carrying the reward data — is shared here, so every backend returns the same batch.

**Output batch** (``TensorDict``, ``batch_size=[B * n]``, samples of prompt ``i`` at rows
``i * n .. i * n + n - 1``): the keys of :func:`verl_trainer.data.packing.make_batch` —
``input_ids`` = prompt + response right-padded ``[B*n, T]``, ``attention_mask``, ``position_ids``,
``loss_mask`` = ``response_mask`` (1 on the response tokens, float32), ``uid`` (the prompt's group id,
shared by its ``n`` samples), ``seq_len``, ``prompt_len``, ``response_len``, ``is_padding`` — plus these
**non-tensor** entries (``tensordict.NonTensorStack``: one Python object per sample; they follow
indexing, ``torch.cat`` and ``repeat_interleave``):

* ``ground_truth``, ``data_source``, ``extra_info``: copied from the prompt batch, for the reward;
* ``response_text``: the decoded response (special tokens skipped).

A response ends at its first eos token, which is **kept** as the last response token (the model learns
to stop; ``response_len`` counts it). A response that hit ``max_new_tokens`` has no eos.

Non-tensor entries cannot travel through tensor collectives (sample exchange, balancing): drop them
with :func:`verl_trainer.data.schema.tensor_only` once rewards are computed.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict

from verl_trainer.data import schema
from verl_trainer.data.packing import make_batch
from verl_trainer.data.prompts import NON_TENSOR_KEYS, collate_prompts, non_tensor_lists, prompt_token_lists
from verl_trainer.rollout.config import RolloutConfig
from verl_trainer.utils.distributed import get_rank

RESPONSE_TEXT = "response_text"
ROLLOUT_NON_TENSOR_KEYS = (*NON_TENSOR_KEYS, RESPONSE_TEXT)
"""Non-tensor keys of a rollout batch."""

_MIX = 1_000_003


def derive_seed(seed: int, rank: int, call: int) -> int:
    """A 63-bit seed for generate call ``call`` on rank ``rank`` of a run seeded with ``seed``."""
    return ((seed * _MIX + rank) * _MIX + call) % (2**63 - 1)


def truncate_at_eos(tokens: Sequence[int], eos_token_ids: Iterable[int]) -> list[int]:
    """Cut a response after its first eos token (kept); without eos, the tokens unchanged.

    Args:
        tokens: Generated ids (any trailing padding after the eos is dropped with the cut).
        eos_token_ids: Ids that end a response.

    Returns:
        The response ids, eos included when present.

    """
    eos = set(eos_token_ids)
    for i, t in enumerate(tokens):
        if t in eos:
            return list(tokens[: i + 1])
    return list(tokens)


class BaseRollout(ABC):
    """Generates ``n`` responses per prompt; receives the trained weights after each update.

    Args:
        config: Sampling and backend settings.
        tokenizer: The model's tokenizer (pad/eos ids, response decoding).

    """

    def __init__(self, config: RolloutConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.pad_token_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        self.eos_token_ids = self._eos_ids(tokenizer)
        self._calls = 0
        self.data_rank: int | None = None
        """The data-parallel rank that seeds sampling (the ranks of one SP / TP group hold the same
        prompts and must sample the same responses); ``None``: the global rank."""

    @staticmethod
    def _eos_ids(tokenizer: Any, extra: int | Sequence[int] | None = None) -> list[int]:
        ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
        if extra is not None:
            ids += [int(e) for e in ([extra] if isinstance(extra, int) else extra)]
        if not ids:
            raise ValueError("the tokenizer has no eos_token_id; a rollout needs one to stop responses")
        return sorted(set(ids))

    # ------------------------------------------------------------------------------------ backend
    @abstractmethod
    def generate_token_ids(self, prompts: list[list[int]], config: RolloutConfig,
                           seed: int) -> list[list[int]]:
        """Sample one response per prompt (prompts arrive already repeated ``n`` times).

        Args:
            prompts: Prompt id lists, no padding.
            config: The sampling settings of this call (``n`` already applied, ignore it).
            seed: The seed of this call (derive every random draw from it).

        Returns:
            One list of generated ids per prompt; the eos cut is applied afterwards by the caller, so
            trailing padding after an eos is harmless.

        """

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load full tensors (e.g. ``engine.get_per_tensor_param()``), one at a time.

        Consumes the whole iterable even when a name is wrong (it may be a collective on every rank),
        then raises ``ValueError`` listing unknown, missing and mis-shaped names.

        Returns:
            The number of tensors loaded.

        """

    def share_weights(self, params: Mapping[str, torch.Tensor]) -> int:
        """Use the actor's parameter storage itself where the backend can (``engine.get_shareable_params()``).

        The default copies (:meth:`update_weights`); the HF rollout aliases the tensors instead, so the
        optimizer's in-place updates reach it without a per-step copy.

        Returns:
            The number of tensors aliased or copied.
        """
        return self.update_weights(params.items())

    # ------------------------------------------------------------------------------------ shared
    def generate(self, prompt_batch: TensorDict | Sequence[Mapping[str, Any]],
                 **overrides: Any) -> TensorDict:
        """Sample ``n`` responses per prompt and return the schema batch (see the module docstring).

        Args:
            prompt_batch: A prompt batch from :func:`verl_trainer.data.prompts.collate_prompts`, or the
                dataset items themselves (dicts with ``input_ids``, ``index``, reward fields).
            **overrides: Per-call :class:`RolloutConfig` fields, e.g. ``n=1, do_sample=False`` for
                validation.

        Returns:
            ``TensorDict`` [B * n] in the schema, plus the non-tensor reward entries.

        """
        if not isinstance(prompt_batch, TensorDict):
            prompt_batch = collate_prompts(list(prompt_batch), self.pad_token_id)
        config = dataclasses.replace(self.config, **overrides) if overrides else self.config
        rank = get_rank() if self.data_rank is None else self.data_rank
        seed = derive_seed(config.seed, rank, self._calls)
        self._calls += 1

        n = config.n
        prompts = [p for p in prompt_token_lists(prompt_batch) for _ in range(n)]
        generated = self.generate_token_ids(prompts, config, seed) if prompts else []
        if len(generated) != len(prompts):
            raise RuntimeError(
                f"{type(self).__name__} returned {len(generated)} responses for {len(prompts)} prompts"
            )
        responses = [truncate_at_eos(g, self.eos_token_ids)[: config.max_new_tokens] for g in generated]
        has_uid = schema.UID in prompt_batch.keys()
        uids = (prompt_batch[schema.UID] if has_uid else torch.arange(len(prompt_batch))).repeat_interleave(n)
        batch = make_batch(prompts, responses, uids=uids, pad_token_id=self.pad_token_id)
        if schema.IS_PADDING in prompt_batch.keys():  # a padding prompt's responses are padding samples
            schema.mark_padding(batch, prompt_batch[schema.IS_PADDING].to(torch.bool).repeat_interleave(n))
        for key, values in non_tensor_lists(prompt_batch).items():
            batch[key] = NonTensorStack.from_list([v for v in values for _ in range(n)])
        texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in responses]
        batch[RESPONSE_TEXT] = NonTensorStack.from_list(texts)
        return batch

    @property
    def num_generate_calls(self) -> int:
        """How many times :meth:`generate` has run (it enters the per-call seed)."""
        return self._calls
