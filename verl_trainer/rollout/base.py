"""The rollout interface: prompt batch in, schema batch of sampled responses out; weights synced in.

A backend implements :meth:`BaseRollout.generate_token_ids` (prompt id lists -> response id lists and the
sampler's log-prob of each id, one seed per response) and :meth:`BaseRollout.update_weights`. The rest —
repeating each prompt ``n`` times, the eos cut, the schema batch, the reward data — is shared here, so
every backend returns the same batch.

**Output batch** (``TensorDict``, ``batch_size=[B * n]``, samples of prompt ``i`` at rows
``i * n .. i * n + n - 1``): the keys of :func:`verl_trainer.data.packing.make_batch` — ``input_ids`` =
prompt + response right-padded ``[B*n, T]``, ``attention_mask``, ``position_ids``, ``loss_mask`` =
``response_mask`` (float32, 1 on the response tokens), ``rollout_log_probs`` ``[B*n, T]`` float32 (at each
response token's position, as ``old_log_probs``; 0 elsewhere), ``uid`` (shared by a prompt's ``n``
samples), ``seq_len``, ``prompt_len``, ``response_len``, ``is_padding`` — plus the non-tensor entries
(``NonTensorStack``: one object per sample, following indexing, ``torch.cat`` and ``repeat_interleave``)
``ground_truth``, ``data_source``, ``extra_info`` (copied from the prompt batch) and ``response_text`` (the
decoded response, special tokens skipped). Drop those with :func:`verl_trainer.data.schema.tensor_only`
before a tensor collective.

A response ends at its first eos token, which is kept as its last token (``response_len`` counts it); a
response that hit ``max_new_tokens`` has no eos. Response ``j`` of prompt ``i`` is sampled from
:func:`derive_sample_seed` ``(seed, step, prompt index, j)`` (the prompt's dataset index, else its ``uid``;
the training step, else the number of earlier :meth:`BaseRollout.generate` calls), so it does not depend on
the rank, the dp size or the other prompts of its batch.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from tensordict import NonTensorStack, TensorDict

from verl_trainer.data import schema
from verl_trainer.data.packing import make_batch
from verl_trainer.data.prompts import collate_prompts
from verl_trainer.data.schema import NON_TENSOR_KEYS, non_tensor_lists, prompt_token_lists
from verl_trainer.rollout.vision import prompt_images
from verl_trainer.utils.listing import first_of

if TYPE_CHECKING:  # the config reads the backend registry, which holds BaseRollout classes
    from transformers import PreTrainedTokenizerBase

    from verl_trainer.rollout.agent_loop import AgentLoop
    from verl_trainer.rollout.config import RolloutConfig

RESPONSE_TEXT = "response_text"
AGENT_INFO = "agent_info"
"""Non-tensor key of a multi-turn rollout: per sample, :meth:`Trajectory.info` (turns, tool calls, reward)."""
ROLLOUT_NON_TENSOR_KEYS = (*NON_TENSOR_KEYS, RESPONSE_TEXT)
"""Non-tensor keys of a rollout batch."""

_MIX = 1_000_003
_MOD = 2**63 - 1


def derive_sample_seed(seed: int, step: int, prompt_index: int, sample_index: int, stream: int = 0) -> int:
    """The 63-bit seed of one response: sample ``sample_index`` of prompt ``prompt_index`` at ``step``.

    Independent of the rank and the batch, so a run samples the same responses at any dp size.
    ``stream`` separates uses of the same step (0: training, 1: validation).
    """
    key = seed
    for part in (stream, step, prompt_index, sample_index):
        key = (key * _MIX + int(part) + 1) % _MOD
    return key


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


def _place_log_probs(batch: TensorDict, log_probs: list[list[float]]) -> torch.Tensor:
    """``[B, T]`` float32: each response's log-probs at its tokens' positions (``prompt_len ..``), else 0."""
    out = torch.zeros(batch[schema.INPUT_IDS].shape, dtype=torch.float32)
    for row, (start, values) in enumerate(zip(batch[schema.PROMPT_LEN].tolist(), log_probs)):
        length = int(batch[schema.RESPONSE_LEN][row])
        if len(values) != length:
            raise RuntimeError(f"response {row}: {len(values)} log-probs for {length} tokens; a backend "
                               "returns one log-prob per generated id")
        out[row, start: start + len(values)] = torch.tensor(values, dtype=torch.float32)
    return out


def weight_mismatch_report(unknown: list[str], missing: list[str], shapes: list[str]) -> str:
    """The ``update_weights`` error of a rollout whose sent tensors do not match its model's.

    Args:
        unknown: Sent names the rollout model does not have.
        missing: Rollout parameters that were not sent.
        shapes: ``"name (sent shape) vs (model shape)"`` entries.
    """
    parts = []
    if unknown:
        parts.append(f"names the rollout model does not have: {first_of(unknown, 5)}")
    if missing:
        parts.append(f"rollout parameters that were not sent: {first_of(missing, 5)}")
    if shapes:
        parts.append(f"shape mismatches: {first_of(shapes, 5)}")
    return (
        "update_weights: the sent tensors do not match the rollout model — " + "; ".join(parts) + ". "
        "Send the HF state_dict names of the same architecture (engine.get_per_tensor_param()); strip "
        "wrapper prefixes such as 'module.' or '_orig_mod.' first."
    )


class BaseRollout(ABC):
    """Generates ``n`` responses per prompt; receives the trained weights after each update.

    A backend class is built as ``cls(config, model, tokenizer)`` by
    :func:`verl_trainer.rollout.build_rollout` (``model``: the policy's checkpoint directory, or a model
    object where the backend takes one; ``tokenizer``: ``None`` means the checkpoint's), after
    :meth:`check`. It declares what it reads and supports in the class attributes below.

    Args:
        config: Sampling and backend settings.
        tokenizer: The model's tokenizer (pad/eos ids, response decoding).

    """

    backend_settings: ClassVar[tuple[str, ...]] = ()
    """The :class:`RolloutConfig` fields only this backend reads (a run with another backend is told it
    ignores them when they differ from their defaults: ``RolloutConfig.ignored_by``)."""
    one_step_off: ClassVar[bool] = False
    accepts_images: ClassVar[bool] = False
    """Whether :meth:`generate_token_ids` takes ``images=`` (one
    :class:`~verl_trainer.rollout.vision.PromptImages` per prompt): prompt batches carrying
    ``schema.PIXEL_VALUES`` / ``schema.IMAGE_GRID_THW`` are refused by a backend without it."""
    """Whether :meth:`generate` may run on a background thread while the actor trains
    (``max_staleness=1``): the backend keeps its own weights, written only between generations, and runs
    no collective while it generates."""

    @classmethod
    def check(cls, config: RolloutConfig, model: str | Path | object) -> None:
        """Raise before any model loads when this backend cannot run ``model`` with ``config`` here.

        The default accepts everything; a backend with an optional package or limits overrides it (the
        recipes call it before the warm start, :func:`~verl_trainer.rollout.build_rollout` before building).

        Raises:
            ImportError, ValueError: Naming the value and the fix.
        """
        return None

    def __init__(self, config: RolloutConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.pad_token_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        self.eos_token_ids = self._eos_ids(tokenizer)
        self._calls = 0
        self.agent_loop: AgentLoop | None = None
        """An :class:`~verl_trainer.rollout.agent_loop.AgentLoop` for multi-turn rollouts (set by
        :func:`verl_trainer.rollout.build_rollout` when ``multi_turn.enable``); ``None``: single-turn."""
        self.context_limit: int | None = None
        """The most tokens (prompt + response) the backend can hold (vLLM's ``max_model_len``); ``None``:
        unbounded. Multi-turn trajectories end when they fill it (a single-turn response is cut there by
        the backend itself)."""
        self.token_sampler: Any = None
        """While set, single-turn :meth:`generate` samples with it instead of :meth:`generate_token_ids`
        (same signature and contract; the partial rollout's
        :class:`~verl_trainer.algorithms.partial_rollout.ChunkedSampler`)."""
        self.data_rank: int | None = None
        """The data-parallel rank of this process (the ranks of one SP / TP group hold the same prompts);
        informational: sampling is seeded per response, not per rank (see the module docstring)."""

    @staticmethod
    def _eos_ids(tokenizer: PreTrainedTokenizerBase, extra: int | Sequence[int] | None = None) -> list[int]:
        ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
        if extra is not None:
            ids += [int(e) for e in ([extra] if isinstance(extra, int) else extra)]
        if not ids:
            raise ValueError("the tokenizer has no eos_token_id; a rollout needs one to stop responses")
        return sorted(set(ids))

    # ------------------------------------------------------------------------------------ backend
    @abstractmethod
    def generate_token_ids(self, prompts: list[list[int]], config: RolloutConfig,
                           seeds: list[int]) -> tuple[list[list[int]], list[list[float]]]:
        """Sample one response per prompt (prompts arrive already repeated ``n`` times).

        Args:
            prompts: Prompt id lists, no padding.
            config: The sampling settings of this call (``n`` already applied, ignore it).
            seeds: One seed per prompt: every random draw of response ``k`` comes from ``seeds[k]``
                (a backend without per-request seeds documents what it does instead).

        Returns:
            ``(ids, log_probs)``: one list of generated ids per prompt, and per id the log-prob the sampler
            drew it with (after temperature / top-k / top-p: vLLM's ``processed_logprobs``). The eos cut is
            applied afterwards by the caller, so trailing padding after an eos is harmless.

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
    def generate(self, prompt_batch: TensorDict | Sequence[Mapping[str, Any]], step: int | None = None,
                 prompt_index: torch.Tensor | None = None, stream: int = 0, **overrides: Any) -> TensorDict:
        """Sample ``n`` responses per prompt and return the schema batch (see the module docstring).

        Args:
            prompt_batch: A prompt batch from :func:`verl_trainer.data.prompts.collate_prompts`, or the
                dataset items themselves (dicts with ``input_ids``, ``index``, reward fields).
            step: The step that seeds the sampling (the trainer's global step); ``None``: the number of
                earlier calls.
            prompt_index: ``[B]`` the prompts' dataset indices (the same on any dp size); ``None``: the
                batch's ``uid`` (``collate_prompts`` sets it to the dataset index).
            stream: Seed stream (0: training, 1: validation), so the two never share seeds.
            **overrides: Per-call :class:`RolloutConfig` fields, e.g. ``n=1, do_sample=False`` for
                validation.

        Returns:
            ``TensorDict`` [B * n] in the schema, plus the non-tensor reward entries.

        """
        if not isinstance(prompt_batch, TensorDict):
            prompt_batch = collate_prompts(list(prompt_batch), self.pad_token_id)
        config = dataclasses.replace(self.config, **overrides) if overrides else self.config
        step = self._calls if step is None else int(step)
        self._calls += 1

        n = config.n
        has_uid = schema.UID in prompt_batch.keys()
        if prompt_index is None:
            prompt_index = prompt_batch[schema.UID] if has_uid else torch.arange(len(prompt_batch))
        seeds = [derive_sample_seed(config.seed, step, int(i), j, stream)
                 for i in prompt_index.tolist() for j in range(n)]
        prompts = [p for p in prompt_token_lists(prompt_batch) for _ in range(n)]
        trajectories = None
        images = self._prompt_images(prompt_batch, n)
        if images is not None:  # a vision-language policy: single-turn, the backend's own sampler
            generated, log_probs = self.generate_token_ids(prompts, config, seeds, images=images)
            responses = [truncate_at_eos(g, self.eos_token_ids)[: config.max_new_tokens] for g in generated]
        elif self.agent_loop is not None and prompts:
            columns = non_tensor_lists(prompt_batch)
            rows = [{k: v[i] for k, v in columns.items()} for i in range(len(prompt_batch)) for _ in range(n)]
            trajectories = self.agent_loop.run(
                self.generate_token_ids, prompts, rows, config, seeds,
                lambda s, turn: derive_sample_seed(s, turn, 0, 0, stream), self.context_limit)
            responses, log_probs = [t.ids for t in trajectories], [t.log_probs for t in trajectories]
        else:
            sample = self.token_sampler or self.generate_token_ids
            generated, log_probs = sample(prompts, config, seeds) if prompts else ([], [])
            if len(generated) != len(prompts) or len(log_probs) != len(prompts):
                raise RuntimeError(f"{type(self).__name__} returned {len(generated)} responses and "
                                   f"{len(log_probs)} log-prob lists for {len(prompts)} prompts")
            responses = [truncate_at_eos(g, self.eos_token_ids)[: config.max_new_tokens] for g in generated]
        uids = (prompt_batch[schema.UID] if has_uid else torch.arange(len(prompt_batch))).repeat_interleave(n)
        batch = make_batch(prompts, responses, uids=uids, pad_token_id=self.pad_token_id)
        batch[schema.ROLLOUT_LOG_PROBS] = _place_log_probs(batch, [lp[: len(r)] for lp, r in
                                                                   zip(log_probs, responses)])
        if trajectories is not None:  # train only the model's tokens: observations are masked out
            mask = _place_log_probs(batch, [[float(m) for m in t.model_mask] for t in trajectories])
            batch[schema.LOSS_MASK] = mask
            batch[schema.RESPONSE_MASK] = mask.clone()
            batch[AGENT_INFO] = NonTensorStack.from_list([t.info() for t in trajectories])
        if schema.IS_PADDING in prompt_batch.keys():  # a padding prompt's responses are padding samples
            schema.mark_padding(batch, prompt_batch[schema.IS_PADDING].to(torch.bool).repeat_interleave(n))
        for key, values in non_tensor_lists(prompt_batch).items():
            batch[key] = NonTensorStack.from_list([v for v in values for _ in range(n)])
        if images is not None:  # each sample keeps its prompt's images, for the training forward
            for key in (schema.PIXEL_VALUES, schema.IMAGE_GRID_THW):
                batch[key] = prompt_batch[key].repeat_interleave(n, dim=0)
        texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in responses]
        batch[RESPONSE_TEXT] = NonTensorStack.from_list(texts)
        return batch

    def _prompt_images(self, prompt_batch: TensorDict, n: int) -> list[Any] | None:
        """Each of the ``B * n`` prompts' images, or ``None`` for a batch without images.

        Raises:
            NotImplementedError: images with a backend that does not take them, a multi-turn rollout or
                a partial rollout (``token_sampler``).
        """
        if schema.IMAGE_GRID_THW not in prompt_batch.keys():  # a text batch never enters rollout/vision.py
            return None
        images = prompt_images(prompt_batch)
        if images is None:
            return None
        if not self.accepts_images:
            raise NotImplementedError(
                f"the prompt batch carries images but the rollout backend {type(self).__name__} does not "
                "generate from images; use rollout.name=hf for a vision-language policy (docs/vlm.md)")
        if self.agent_loop is not None or self.token_sampler is not None:
            raise NotImplementedError(
                "prompts with images are generated single-turn and in one piece: set "
                "multi_turn.enable=false and turn the partial rollout off for a vision-language policy")
        return [im for im in images for _ in range(n)]

    @property
    def num_generate_calls(self) -> int:
        """How many times :meth:`generate` has run (the seeding step when no ``step`` is given)."""
        return self._calls
