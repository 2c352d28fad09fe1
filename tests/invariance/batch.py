"""The fixed global batch of the invariance matrix, and how each case splits it over ranks.

12 samples with a long-tailed length mix (3 .. 60 tokens), shuffled so contiguous shards mix short and
long; sample 5 has an all-zero loss mask (a real sample that trains nothing). The RL fields are
deterministic and keep every discrete decision far from its threshold, so round-off cannot flip one
(a flipped clip decision would be a real difference, not noise):

* ``old_log_probs = log_probs_0 + d`` with ``d`` in {-1.5, -0.5, -0.05, 0.05, 0.5}, where ``log_probs_0``
  are the initial policy's log-probs: ratios ``exp(-d)`` lie well inside or well outside the clip range
  [0.8, 1.2] and the dual-clip bound 3 (e^1.5 = 4.5), so ``pg_clipfrac`` and ``pg_clipfrac_lower`` are
  non-trivial and stable;
* ``values = values_0 + e`` with ``e`` in {-1, -0.1, 0.1, 1} around the initial critic's values:
  ``|e|`` is far from ``cliprange_value = 0.5``, so ``vf_clipfrac`` is stable;
* ``ref_log_prob``, ``advantages`` and ``returns`` are seeded noise;
* ``rollout_log_probs = old_log_probs + d'`` with ``d'`` in {-1, -0.2, 0.2, 1}: rollout -> trainer ratios
  ``exp(-d')`` of 2.7, 1.2, 0.8, 0.37, far from the truncation threshold 2 of the ``ppo_is`` loss.

:func:`multi_turn_batch` is the same batch laid out as a multi-turn rollout makes it (``ppo_mt`` cases).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from tests.engine.common import VOCAB_HIGH, VOCAB_LOW, padded_log_probs, padded_values
from tests.invariance.cases import (
    DISTILL_LOSSES,
    MOE_REPLAY_LOSS,
    MULTI_TURN_LOSS,
    PREFERENCE_LOSSES,
    RM_LOSS,
    Case,
)
from tests.invariance.distill import distill_batch
from verl_trainer.data import schema
from verl_trainer.data.packing import make_batch
from verl_trainer.models.loading import load_causal_lm, load_value_model

SEQ_LENS = (14, 3, 38, 6, 9, 25, 4, 60, 7, 11, 5, 18)
PROMPT_LENS = (4, 1, 6, 2, 3, 5, 2, 6, 3, 4, 2, 5)
ZERO_MASK_SAMPLE = 5
VALUE_SEED = 42  # EngineConfig.seed: the value head is initialised from it on every rank
UNEVEN_SIZES = {1: [12], 2: [9, 3], 4: [6, 3, 2, 1]}
"""Starting split when SequenceBalancing is on: deliberately uneven, so balancing must move samples."""
BATCH_MULTIPLE = 8
"""Balancing pads the 12 samples to 16: four ``is_padding`` samples that must change nothing."""


def _choice(options: tuple[float, ...], shape: torch.Size, g: torch.Generator) -> torch.Tensor:
    idx = torch.randint(0, len(options), shape, generator=g)
    return torch.tensor(options)[idx]


@torch.no_grad()
def initial_outputs(model_path: str, batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_probs [B, T], values [B, T])`` of the initial actor and critic (plain HF, padded, sdpa)."""
    actor = load_causal_lm(model_path, attn_implementation="sdpa")
    logits = actor(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    critic = load_value_model(model_path, attn_implementation="sdpa", seed=VALUE_SEED)
    values = critic(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return padded_log_probs(logits, batch["input_ids"]), padded_values(values)


def make_invariance_batch(model_path: str, seed: int = 0) -> TensorDict:
    """The fixed batch ``[12, 60]`` with every field the three losses read."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for total, prompt in zip(SEQ_LENS, PROMPT_LENS):
        ids = torch.randint(VOCAB_LOW, VOCAB_HIGH, (total,), generator=g).tolist()
        prompts.append(ids[:prompt])
        responses.append(ids[prompt:])
    batch = make_batch(prompts, responses)
    batch["loss_mask"][ZERO_MASK_SAMPLE] = 0.0
    mask = batch["response_mask"]
    shape = mask.shape
    log_probs_0, values_0 = initial_outputs(model_path, batch)
    batch["old_log_probs"] = (log_probs_0 + _choice((-1.5, -0.5, -0.05, 0.05, 0.5), shape, g)) * mask
    batch["ref_log_prob"] = (log_probs_0 + 0.3 * torch.randn(shape, generator=g)) * mask
    adv = torch.randn(len(SEQ_LENS), 1, generator=g) + 0.3 * torch.randn(shape, generator=g)
    batch["advantages"] = adv * mask
    batch["values"] = (values_0 + _choice((-1.0, -0.1, 0.1, 1.0), shape, g)) * mask
    batch["returns"] = torch.randn(shape, generator=g) * mask
    batch["rollout_log_probs"] = (batch["old_log_probs"] + _choice((-1.0, -0.2, 0.2, 1.0), shape, g)) * mask
    return batch


def shard_for(batch: TensorDict, rank: int, dp: int, balance: bool) -> TensorDict:
    """This rank's starting samples: equal contiguous shards, or the uneven split when balancing."""
    sizes = UNEVEN_SIZES[dp] if balance else [batch.batch_size[0] // dp] * dp
    start = sum(sizes[:rank])
    return batch[start : start + sizes[rank]]


MIN_MULTI_TURN_RESPONSE = 6
"""Responses at least this long hold a tool-observation span (shorter ones are single-turn)."""


def multi_turn_batch(batch: TensorDict) -> TensorDict:
    """``batch`` as a multi-turn rollout lays it out: a tool-observation span inside each longer response.

    Response ``r`` tokens long (``r >= MIN_MULTI_TURN_RESPONSE``): model turn, then observation tokens at
    response positions ``[r // 3, r // 3 + max(2, r // 4))``, then the model's next turn. On the span
    ``loss_mask`` and ``response_mask`` are 0 and every per-token RL field is 0, as
    :class:`~verl_trainer.rollout.AgentLoop` leaves them (``rollout_log_probs`` 0 on observations).
    """
    batch = batch.clone()
    observation = torch.zeros_like(batch["response_mask"], dtype=torch.bool)
    for i, (p, r) in enumerate(zip(batch["prompt_len"].tolist(), batch["response_len"].tolist())):
        if r >= MIN_MULTI_TURN_RESPONSE:
            start = p + r // 3
            observation[i, start: start + max(2, r // 4)] = True
    for key in ("loss_mask", "response_mask", "old_log_probs", "ref_log_prob", "advantages", "values",
                "returns", "rollout_log_probs"):
        batch[key] = batch[key].masked_fill(observation, 0.0)
    return batch


# ---------------------------------------------------------------- preference block (DPO sigmoid, KTO)
PREFERENCE_KL_REFERENCE = 0.25
"""KTO's reference point on every sample (the module estimates it before the update; the loss reads it)."""


def preference_batch(batch: TensorDict) -> TensorDict:
    """``batch`` as preference pairs: samples ``2p`` (chosen), ``2p + 1`` (rejected) share ``group_id = p``.

    Pair (8, 9) straddles the uneven dp=2 split (``UNEVEN_SIZES``), so balancing must bring it together;
    the longest pair (4 + 60 tokens) just fits the dynamic budget of 64. Sample 5 (no loss token) is the
    rejected of pair 2. KTO reads ``preferred`` as its labels and ``kl_reference`` as its ``z0``.
    """
    batch = batch.clone()
    n = batch.batch_size[0]
    batch[schema.GROUP_ID] = torch.arange(n) // 2
    batch[schema.PREFERRED] = (torch.arange(n) % 2 == 0).float()
    batch[schema.KL_REFERENCE] = torch.full((n,), PREFERENCE_KL_REFERENCE)
    return batch


# ---------------------------------------------------------------- reward-model block (Bradley–Terry)
def rm_batch(batch: TensorDict) -> TensorDict:
    """:func:`preference_batch`'s pairs with a per-pair margin (``pair_margin``: 0, 0.5, 1, 1.5, 0, ...).

    The loss reads each row's value at ``seq_len - 1`` (the score).
    """
    from verl_trainer.data.reward_pairs import PAIR_MARGIN

    batch = preference_batch(batch)
    n = batch.batch_size[0]
    batch[PAIR_MARGIN] = 0.5 * ((torch.arange(n) // 2) % 4).float()
    return batch


def batch_for(case: Case, batch: TensorDict) -> TensorDict:
    """The global batch ``case`` trains on: :func:`multi_turn_batch` for ``ppo_mt``, else ``batch``."""
    if case.loss == RM_LOSS:
        return rm_batch(batch)
    if case.loss in PREFERENCE_LOSSES:
        return preference_batch(batch)
    if case.loss in DISTILL_LOSSES:  # the distillation block: the batch with a teacher's fields
        return distill_batch(batch, VOCAB_LOW, VOCAB_HIGH, top_k=case.loss == "distill_topk")
    if case.loss == MOE_REPLAY_LOSS:  # the MoE block: a recorded routing to replay
        return moe_batch(batch)
    return multi_turn_batch(batch) if case.loss == MULTI_TURN_LOSS else batch


MOE_LAYERS, MOE_EXPERTS, MOE_TOP_K = 2, 4, 2


def moe_batch(batch: TensorDict, seed: int = 5) -> TensorDict:
    """``batch`` plus ``routed_experts [B, T, 2, 2]``: two distinct random experts per token and layer
    (-1 on the last real token of each row, as a rollout leaves it; padding positions -1)."""
    g = torch.Generator().manual_seed(seed)
    b, t = batch["input_ids"].shape
    routed = torch.rand(b, t, MOE_LAYERS, MOE_EXPERTS, generator=g).argsort(-1)[..., :MOE_TOP_K]
    lengths = batch["attention_mask"].sum(-1).long()
    positions = torch.arange(t)[None, :]
    recorded = positions < (lengths - 1)[:, None]
    out = batch.clone()
    out["routed_experts"] = torch.where(recorded[..., None, None], routed, torch.full_like(routed, -1))
    return out


# ---------------------------------------------------------------- vision-language block (issue 44)
VLM_IMAGE_SIZES = ((56, 56), (84, 56))
"""16 or 24 patch rows (4 or 6 image tokens) per image: every sample's tokens + patch rows fit the VLM
block's dynamic budget (``runner.VLM_DYNAMIC_BUDGET``)."""


@torch.no_grad()
def vlm_invariance_batch(model_path: str, seed: int = 3) -> TensorDict:
    """12 samples with 0, 1 or 2 images each and the PPO fields, built as :func:`make_invariance_batch`
    builds them (``old_log_probs`` around the initial VLM's own log-probs, per unpacked row with its mrope
    positions); sample 5 has an all-zero loss mask."""
    from transformers import AutoModelForImageTextToText

    from verl_trainer.testing.vlm_batch import hf_reference_log_probs, vlm_batch

    batch = vlm_batch(len(SEQ_LENS), seed=seed, sizes=VLM_IMAGE_SIZES)
    batch["loss_mask"][ZERO_MASK_SAMPLE] = 0.0
    g = torch.Generator().manual_seed(seed)
    mask = batch["response_mask"]
    shape = mask.shape
    model = AutoModelForImageTextToText.from_pretrained(model_path, attn_implementation="sdpa").eval()
    log_probs_0 = hf_reference_log_probs(model, batch)
    batch["old_log_probs"] = (log_probs_0 + _choice((-1.5, -0.5, -0.05, 0.05, 0.5), shape, g)) * mask
    batch["ref_log_prob"] = (log_probs_0 + 0.3 * torch.randn(shape, generator=g)) * mask
    adv = torch.randn(len(SEQ_LENS), 1, generator=g) + 0.3 * torch.randn(shape, generator=g)
    batch["advantages"] = adv * mask
    return batch
