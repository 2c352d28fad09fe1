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
    token_level_scores (float).

Rollout keys (optional, before concatenation): prompts ``[B, P]`` left-padded, responses ``[B, R]``
right-padded.

Per-sample tags, ``[B]``:
    uid (long; samples of one prompt group share it), seq_len (long, real tokens),
    prompt_len (long), response_len (long), is_padding (bool; synthetic samples added by
    ``upsample_batch_to_multiple``, their loss_mask is all zero).
"""

from __future__ import annotations

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
LOSS_MASK = "loss_mask"
RESPONSE_MASK = "response_mask"
PROMPTS = "prompts"
RESPONSES = "responses"
OLD_LOG_PROBS = "old_log_probs"
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

TOKEN_KEYS = (
    INPUT_IDS,
    ATTENTION_MASK,
    POSITION_IDS,
    LOSS_MASK,
    RESPONSE_MASK,
    OLD_LOG_PROBS,
    REF_LOG_PROB,
    VALUES,
    ADVANTAGES,
    RETURNS,
    TOKEN_LEVEL_REWARDS,
    TOKEN_LEVEL_SCORES,
)
"""Keys whose tensors are ``[B, T]`` and aligned with ``input_ids``."""

SAMPLE_KEYS = (UID, SEQ_LEN, PROMPT_LEN, RESPONSE_LEN, IS_PADDING)
"""Per-sample tags, ``[B]``."""
