"""The batch schema: canonical keys of a rollout / training batch on a ``TensorDict``.

A batch is a ``tensordict.TensorDict`` with ``batch_size=[B]``. Token-level fields are **right-padded
to a common width T and aligned with ``input_ids``** (prompt and response concatenated): position ``t``
of every per-token field refers to token ``input_ids[:, t]``. Per-token log-probs follow the
next-token convention: ``log_probs[:, t] = log p(input_ids[:, t] | input_ids[:, :t])`` (position 0 has
no prediction and is always 0 / masked). Padding positions hold 0 and are 0 in ``attention_mask``.
The engine never computes on padding: it packs each micro-batch into one row (see
``verl_trainer.data.packing``).

Token-level keys, ``[B, T]``:
    input_ids (long), attention_mask (long/bool, 1 = real token), position_ids (long, 0..L-1),
    loss_mask (float or bool, 1 = trained target token; for RL the response tokens, for SFT the
    answer tokens), response_mask (same as loss_mask for RL rollouts before any masking),
    old_log_probs, ref_log_prob, values, advantages, returns, token_level_rewards,
    token_level_scores (float), rollout_log_probs (float32: the sampler's log-prob of each response
    token, from the distribution it sampled from; 0 off the response; set by every rollout).

Rollout keys (optional, before concatenation): prompts ``[B, P]`` left-padded, responses ``[B, R]``
right-padded.

Distillation keys (:mod:`verl_trainer.algorithms.distill`), aligned with ``input_ids`` like the token keys:
    teacher_log_probs ``[B, T]`` (float32: the teacher's log-prob of each sampled token), teacher_topk_ids
    ``[B, T, k]`` (long: the teacher's ``k`` most likely tokens of the distribution that chose token ``t``)
    and teacher_topk_log_probs ``[B, T, k]`` (float32: their log-probs); 0 off the response. A batch that
    carries teacher_topk_ids makes a language-model engine also return ``gathered_log_probs`` ``[B, T, k]``
    (its own log-probs of those ids, ``engine/heads.py``).

Per-sample tags, ``[B]``:
    uid (long; samples of one prompt group share it), seq_len (long, real tokens),
    prompt_len (long), response_len (long), is_padding (bool; synthetic samples added by
    ``upsample_batch_to_multiple``, their loss_mask is all zero).

Per-sample values, ``[B]``:
    reward_baselines (float32; ReMax: the reward of the greedy response to the sample's prompt,
    :mod:`verl_trainer.algorithms.greedy_baseline`).

Sample groups, ``[B]`` (optional; docs/preference.md):
    group_id (long, >= 0): samples sharing it are read together by one loss term (a preference pair):
    ``balance_batch`` brings them onto one data-parallel rank (ids are unique over the DP group; the
    preference module offsets each rank's), ``prepare_micro_batches`` keeps them in one micro-batch
    (distinct from ``uid``, whose GRPO groups balancing may split). Without it no
    sample is tied to another. Preference data also carries ``preferred`` (float32: 1 the chosen /
    desirable completion, 0 the rejected / undesirable one), ``kl_sample`` (bool: a KTO mismatched
    prompt-completion row, read for the KL reference point only) and ``kl_reference`` (float32: KTO's KL
    reference point of the step, the same value on every sample).

The batch's behaviour lives here too, one definition each: :func:`sequence_lengths`, :func:`real_mask`,
:func:`sample_groups`,
:func:`num_real`, :func:`padding_samples` / :func:`append_padding` (synthetic samples that train
nothing), :func:`tensor_only`, the per-sample Python objects as lists (:func:`non_tensor_lists`) and the
prompts without their left padding (:func:`prompt_token_lists`); a batch that lacks what they need
raises :class:`BatchSchemaError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict, is_non_tensor

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
LOSS_MASK = "loss_mask"
RESPONSE_MASK = "response_mask"
PROMPTS = "prompts"
RESPONSES = "responses"
OLD_LOG_PROBS = "old_log_probs"
ROLLOUT_LOG_PROBS = "rollout_log_probs"
REF_LOG_PROB = "ref_log_prob"
VALUES = "values"
ADVANTAGES = "advantages"
RETURNS = "returns"
TOKEN_LEVEL_REWARDS = "token_level_rewards"
TOKEN_LEVEL_SCORES = "token_level_scores"

UID = "uid"
SEQ_LEN = "seq_len"
PROMPT_LEN = "prompt_len"
RESPONSE_LEN = "response_len"
IS_PADDING = "is_padding"
REWARD_BASELINES = "reward_baselines"
GROUP_ID = "group_id"
PREFERRED = "preferred"
KL_SAMPLE = "kl_sample"
KL_REFERENCE = "kl_reference"
TEACHER_LOG_PROBS = "teacher_log_probs"
TEACHER_TOPK_IDS = "teacher_topk_ids"
TEACHER_TOPK_LOG_PROBS = "teacher_topk_log_probs"
ROUTED_EXPERTS = "routed_experts"
"""Mixture-of-experts router replay: ``[B, T, L, k]`` long, the experts each token was routed to in each MoE
layer (``-1``: not recorded, the token routes freely); a token field (``models/router_replay.py``)."""
PIXEL_VALUES = "pixel_values"
"""Vision-language samples: ``[B, P, D]`` float, sample ``i``'s image patch rows (all its images, in prompt
order) in rows ``0..n_i-1`` and zeros after (``P`` = the batch's largest ``n_i``; ``D`` = channels x temporal
patch x patch**2). A per-sample field: it travels with its sample through balancing and micro-batching
(``data/vision.py``)."""
IMAGE_GRID_THW = "image_grid_thw"
"""Vision-language samples: ``[B, I, 3]`` long, the (t, h, w) patch grid of each of sample ``i``'s images,
zero rows after its last; ``n_i = sum(t * h * w)`` over its rows (``data/vision.py``)."""

GROUND_TRUTH = "ground_truth"
DATA_SOURCE = "data_source"
EXTRA_INFO = "extra_info"
COLUMNS = "columns"
NON_TENSOR_KEYS = (GROUND_TRUTH, DATA_SOURCE, EXTRA_INFO, COLUMNS)
"""Per-sample Python objects carried in prompt and rollout batches as ``NonTensorStack`` entries."""

TOKEN_KEYS = (
    INPUT_IDS,
    ATTENTION_MASK,
    POSITION_IDS,
    LOSS_MASK,
    RESPONSE_MASK,
    OLD_LOG_PROBS,
    ROLLOUT_LOG_PROBS,
    REF_LOG_PROB,
    VALUES,
    ADVANTAGES,
    RETURNS,
    TOKEN_LEVEL_REWARDS,
    TOKEN_LEVEL_SCORES,
)
"""Keys whose tensors are ``[B, T]`` and aligned with ``input_ids``."""

VISION_KEYS = (PIXEL_VALUES, IMAGE_GRID_THW)
"""Per-sample image fields, ``[B, P, D]`` / ``[B, I, 3]``: never token fields, whatever their widths."""

SAMPLE_KEYS = (UID, SEQ_LEN, PROMPT_LEN, RESPONSE_LEN, IS_PADDING)
"""Per-sample tags, ``[B]``."""


class BatchSchemaError(ValueError):
    """A batch lacks a field (or has a malformed one) that an operation on it needs."""


def sequence_lengths(batch: TensorDict) -> torch.Tensor:
    """Real tokens per sample, ``[B]`` long.

    From ``seq_len`` when present, else ``attention_mask.sum(-1)``, else the offsets of a jagged
    (nested) ``input_ids``.

    Raises:
        BatchSchemaError: None of them is in ``batch``.
    """
    keys = batch.keys()
    if SEQ_LEN in keys:
        return batch[SEQ_LEN].to(torch.long)
    if ATTENTION_MASK in keys:
        return batch[ATTENTION_MASK].to(torch.long).sum(-1)
    if INPUT_IDS in keys and batch[INPUT_IDS].is_nested:
        return batch[INPUT_IDS].offsets().diff().to(torch.long)
    raise BatchSchemaError(
        f"the batch has neither {SEQ_LEN!r} nor {ATTENTION_MASK!r} (keys: {sorted(keys)}); build batches "
        "with verl_trainer.data.packing.make_batch so per-sample lengths are known"
    )



def sample_sizes(batch: TensorDict) -> torch.Tensor:
    """A sample's compute size for balancing and dynamic micro-batching, ``[B]`` long.

    Its :func:`sequence_lengths` plus, for a vision-language sample, its images' patch rows (``t * h * w`` per
    row of ``image_grid_thw``, before the vision tower's 2x2 merge): the vision blocks run on every patch row,
    the language model on every token.
    """
    lens = sequence_lengths(batch)
    if IMAGE_GRID_THW not in batch.keys():
        return lens
    return lens + patch_counts(batch[IMAGE_GRID_THW]).to(lens)


def patch_counts(image_grid_thw: torch.Tensor) -> torch.Tensor:
    """Patch rows per sample, ``[B]`` long, from a per-sample ``[B, I, 3]`` grid (zero rows count 0)."""
    return image_grid_thw.prod(-1).sum(-1)


def real_mask(batch: TensorDict) -> torch.Tensor:
    """``[B]`` bool: True for real samples, False for synthetic ``is_padding`` ones (all True untagged)."""
    if IS_PADDING in batch.keys():
        return ~batch[IS_PADDING].to(torch.bool)
    return torch.ones(batch.batch_size[0], dtype=torch.bool, device=batch.device)


def num_real(batch: TensorDict) -> int:
    """The number of real (not ``is_padding``) samples of ``batch``."""
    return int(real_mask(batch).sum())


def tensor_only(batch: TensorDict) -> TensorDict:
    """``batch`` without its non-tensor entries (before sample exchange, balancing or an engine)."""
    return batch.exclude(*[k for k in batch.keys() if is_non_tensor(batch.get(k))])


def sample_groups(batch: TensorDict) -> list[list[int]]:
    """Row indices of each ``group_id`` group, in order of first appearance; a padding row is a group alone.

    Raises:
        BatchSchemaError: ``batch`` has no ``group_id``.
    """
    if GROUP_ID not in batch.keys():
        raise BatchSchemaError(f"the batch has no {GROUP_ID!r} (keys: {sorted(batch.keys())})")
    ids = batch[GROUP_ID].tolist()
    padding = real_mask(batch).logical_not().tolist()
    groups: dict[object, list[int]] = {}
    for i, (gid, pad) in enumerate(zip(ids, padding)):
        groups.setdefault(("padding", i) if pad else gid, []).append(i)
    return list(groups.values())


def _shortest_real_sample(batch: TensorDict) -> int:
    """Index of the shortest real sample (of any sample when all are padding; 0 without lengths)."""
    try:
        lens = sequence_lengths(batch)
    except BatchSchemaError:
        return 0
    real = real_mask(batch)
    if real.any():
        lens = torch.where(real, lens, lens.max() + 1)
    return int(lens.argmin())


def padding_samples(batch: TensorDict, count: int, first_uid: int | None = None) -> TensorDict:
    """``count`` synthetic samples shaped like ``batch``'s, that train nothing.

    Each is a one-token sequence: every tensor field is 0 except ``input_ids[:, 0]`` (the first token of
    the shortest real sample, 0 if there is none) and ``attention_mask[:, 0] = 1``; so ``loss_mask`` and
    ``response_mask`` are all zero and the sample adds nothing to a loss or to ``batch_num_tokens``.
    ``is_padding = True`` (always set); where ``batch`` has them: ``seq_len = prompt_len = 1``,
    ``response_len = 0`` and a fresh ``uid`` each (``first_uid``, ``+ 1``, ...; default ``max(uid) + 1``),
    so no padding sample joins a real prompt group. Non-tensor fields are copied from the shortest real
    sample.

    Args:
        batch: A batch ``[B]``; may be empty if it has only tensor fields (their shapes are used).
        count: Number of samples to make.
        first_uid: The first padding uid (to keep uids unique over several ranks).

    Returns:
        A ``TensorDict`` ``[count]`` with the keys of ``batch`` plus ``is_padding``.
    """
    size = batch.batch_size[0]
    if size:
        template = _shortest_real_sample(batch)
        extra = batch[[template] * count].clone().zero_()
    else:
        template = None
        extra = batch.apply(lambda t: t.new_zeros((count, *t.shape[1:])), batch_size=[count])
    if INPUT_IDS in batch.keys() and batch[INPUT_IDS].shape[-1] > 0:
        if template is not None:
            extra[INPUT_IDS][:, 0] = batch[INPUT_IDS][template, 0]
        if ATTENTION_MASK in batch.keys():
            extra[ATTENTION_MASK][:, 0] = 1
    for key in (SEQ_LEN, PROMPT_LEN):
        if key in batch.keys():
            extra[key].fill_(1)
    extra.set(IS_PADDING, torch.ones(count, dtype=torch.bool, device=extra.device))
    if UID in batch.keys():
        uid = batch[UID]
        if first_uid is None:
            first_uid = int(uid.max()) + 1 if size else 0
        extra.set(UID, first_uid + torch.arange(count, dtype=uid.dtype, device=uid.device))
    return extra


def with_padding_tag(batch: TensorDict) -> TensorDict:
    """``batch`` with an ``is_padding`` tag (all False when it had none; a shallow copy then)."""
    if IS_PADDING in batch.keys():
        return batch
    tagged = batch.clone(recurse=False)
    tagged.set(IS_PADDING, torch.zeros(batch.batch_size[0], dtype=torch.bool, device=batch.device))
    return tagged


def mark_padding(batch: TensorDict, rows: torch.Tensor) -> TensorDict:
    """Turn the real samples at ``rows`` into padding, in place: tagged ``is_padding``, masks zeroed.

    For rows that duplicate a real sample (the distributed sampler pads the data to a multiple of the DP
    size by repeating it) or that must not train (a non-finite reward): they stay in the batch, so every
    rank keeps its shape and its collectives, but count in no metric, no loss and no denominator.

    Args:
        batch: A batch ``[B]``.
        rows: ``[B]`` bool, the samples to turn into padding.

    Returns:
        ``batch`` (tagged; ``loss_mask`` / ``response_mask`` zero on ``rows`` where present).
    """
    rows = rows.to(device=batch.device, dtype=torch.bool)
    tag = batch[IS_PADDING].to(torch.bool) if IS_PADDING in batch.keys() else torch.zeros_like(rows)
    batch.set(IS_PADDING, tag | rows)
    for key in (LOSS_MASK, RESPONSE_MASK):
        if key in batch.keys() and rows.any():
            mask = batch[key].clone()
            mask[rows] = 0
            batch.set(key, mask)
    return batch


def append_padding(batch: TensorDict, count: int, first_uid: int | None = None) -> TensorDict:
    """``batch`` followed by ``count`` :func:`padding_samples` (tagged ``is_padding``)."""
    if count <= 0:
        return batch
    return torch.cat([with_padding_tag(batch), padding_samples(batch, count, first_uid)])


def concat_batches(batches: list[TensorDict]) -> TensorDict:
    """One batch of several schema batches (``accumulate_grad_batches``).

    Token keys are right-padded to the widest ``T`` with zeros, per-sample keys stacked; ``uid`` values
    are offset so that samples of different batches never share a group.

    Raises:
        BatchSchemaError: The batches do not have the same keys.
    """
    keys = set(batches[0].keys())
    if any(set(b.keys()) != keys for b in batches[1:]):
        raise BatchSchemaError(
            f"cannot join batches with different keys: {[sorted(b.keys()) for b in batches]}"
        )
    width = max((b[INPUT_IDS].shape[1] for b in batches if INPUT_IDS in keys), default=0)
    parts, offset = [], 0
    for b in batches:
        b = b.clone(recurse=False)
        pad = width - b[INPUT_IDS].shape[1] if INPUT_IDS in keys else 0
        for key in keys:
            value = b.get(key)
            if pad and isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == width - pad:
                widened = torch.nn.functional.pad(value, (0, 0) * (value.dim() - 2) + (0, pad))
                b = b.exclude(key)
                b[key] = widened
        if UID in keys:
            uid = b[UID]
            b[UID] = uid + offset
            offset += int(uid.max()) + 1 if uid.numel() else 0
        parts.append(b)
    return torch.cat(parts, dim=0)


def prompt_token_lists(batch: TensorDict) -> list[list[int]]:
    """The prompts of a prompt batch without their left padding, as id lists."""
    prompts, lens = batch[PROMPTS], batch[PROMPT_LEN].tolist()
    width = prompts.shape[1]
    return [prompts[i, width - n:].tolist() for i, n in enumerate(lens)]


def non_tensor_list(batch: TensorDict, key: str) -> list[Any]:
    """The per-sample Python objects under a non-tensor ``key``, as a plain list of length ``B``.

    Works for a ``NonTensorStack`` (one object per sample) and a ``NonTensorData`` (one object shared
    by every sample, e.g. set with ``batch.set_non_tensor``).
    """
    values = batch.get(key).tolist()
    return values if isinstance(values, list) else [values] * batch.batch_size[0]


def non_tensor_lists(batch: TensorDict, keys: Sequence[str] = NON_TENSOR_KEYS) -> dict[str, list[Any]]:
    """:func:`non_tensor_list` for each of ``keys`` present in ``batch``."""
    return {k: non_tensor_list(batch, k) for k in keys if k in batch.keys()}
