"""Reward-model training data: preference pairs as the reward model reads them at inference.

Rows are the preference formats of :mod:`verl_trainer.data.preference` (explicit or implicit prompt, text
or conversational, verl's parquet layout) with an optional ``margin`` column (a number per pair, TRL's
``RewardTrainer``). A conversational completion is one assistant message (its content is the response).

Each completion is encoded exactly as
:class:`~verl_trainer.algorithms.reward_model.RewardModel` encodes a rollout's prompt and decoded response
(:func:`reward_model_ids`): the reward model's own tokenizer on ``prompt + response`` text (no special
tokens added, no eos), or, for a message-list prompt, the chat template with the response as the
assistant turn (the contents joined by new lines when the tokenizer has no template). One extra token (the
eos, else the pad, else 0) follows, so that a value-model engine's output there is the head at the last
real token: the sequence's score. A row longer than ``max_length - 1`` tokens is refused (inference keeps
the last ``max_length - 1`` instead).

Batches (:func:`collate_reward_pairs`): rows ``2p`` (chosen, ``preferred = 1``) and ``2p + 1`` (rejected)
share ``group_id = p``; the extra token is each row's ``loss_mask`` (one per row); ``pair_margin`` when
the rows have a margin.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from tensordict import TensorDict
from torch.utils.data import Dataset

from verl_trainer.data import schema
from verl_trainer.data.packing import make_batch
from verl_trainer.data.preference import extract_prompt
from verl_trainer.data.prompts import read_rows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["PAIR_MARGIN", "RewardPair", "RewardPairDataset", "collate_reward_pairs", "extra_token_id",
           "reward_model_ids"]


PAIR_MARGIN = "pair_margin"
"""Batch key ``[B]`` float32: the pair's margin ``m``, the same on its two rows (optional)."""


class RewardPair(NamedTuple):
    """A tokenised pair: the reward model's ids of prompt + chosen and prompt + rejected, and the margin."""

    chosen_ids: list[int]
    rejected_ids: list[int]
    margin: float | None


def reward_model_ids(tokenizer: PreTrainedTokenizerBase, prompt: Any, response: str) -> list[int]:
    """The reward model's token ids of ``prompt`` (text or messages) followed by ``response`` (text)."""
    if isinstance(prompt, (list, tuple)):
        if getattr(tokenizer, "chat_template", None):
            messages = [*prompt, {"role": "assistant", "content": response}]
            text = tokenizer.apply_chat_template(messages, tokenize=False)
            return list(tokenizer.encode(text, add_special_tokens=False))
        prompt = "\n".join(str(m["content"]) for m in prompt)
    return list(tokenizer.encode(str(prompt) + response, add_special_tokens=False))


def extra_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The token appended after each sequence: the eos, else the pad, else 0 (as at inference)."""
    return int(next(t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id, 0) if t is not None))


def _response(value: Any, name: str, where: str) -> str:
    """A completion as text: a string, or one assistant message's content."""
    if isinstance(value, str):
        return value
    if (isinstance(value, (list, tuple)) and len(value) == 1 and isinstance(value[0], Mapping)
            and value[0].get("role") == "assistant" and isinstance(value[0].get("content"), str)):
        return value[0]["content"]
    raise ValueError(f"{where}{name!r} must be text or one assistant message [{{'role': 'assistant', "
                     f"'content': ...}}] (what a reward model scores), got {value!r:.80}")


def encode_reward_pair(row: Any, tokenizer: PreTrainedTokenizerBase, max_length: int,
                       where: str = "") -> RewardPair:
    """One preference row (module docstring) as a :class:`RewardPair`.

    Raises:
        ValueError: Missing columns, a completion that is not text or one assistant message, a margin that
            is not a number, or a sequence longer than ``max_length - 1`` tokens (naming the row).
    """
    if not isinstance(row, Mapping) or "chosen" not in row or "rejected" not in row:
        have = sorted(row) if isinstance(row, Mapping) else type(row).__name__
        raise ValueError(f"{where}a reward-model pair needs 'chosen' and 'rejected' (and 'prompt', or a "
                         f"prompt they share as a prefix); it has {have}")
    if row.get("prompt") is not None:
        prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
    else:
        prompt, chosen, rejected = extract_prompt(row["chosen"], row["rejected"], where)
    margin = row.get("margin")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))):
        raise ValueError(f"{where}'margin' must be a number (or absent), got {margin!r}")
    ids = []
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        tokens = reward_model_ids(tokenizer, prompt, _response(value, name, where))
        if len(tokens) + 1 > max_length:
            raise ValueError(f"{where}prompt + {name} is {len(tokens)} tokens; with the score token that is "
                             f"> data.max_length={max_length}: raise data.max_length or shorten the row")
        ids.append(tokens)
    return RewardPair(ids[0], ids[1], None if margin is None else float(margin))


def collate_reward_pairs(items: Sequence[RewardPair], extra_id: int, pad_token_id: int = 0) -> TensorDict:
    """Schema batch ``[2P, T]`` of ``P`` pairs (module docstring).

    Raises:
        ValueError: Some pairs have a margin and others not.
    """
    rows = [list(ids) for p in items for ids in (p.chosen_ids, p.rejected_ids)]
    batch = make_batch(rows, [[extra_id]] * len(rows), pad_token_id=pad_token_id)
    batch.set(schema.GROUP_ID, torch.arange(len(items)).repeat_interleave(2))
    batch.set(schema.PREFERRED, torch.tensor([1.0, 0.0] * len(items)))
    margins = [p.margin for p in items]
    if any(m is not None for m in margins):
        if any(m is None for m in margins):
            raise ValueError("some pairs have a 'margin' and others not; give every row one (0 for none)")
        batch.set(PAIR_MARGIN, torch.tensor(margins, dtype=torch.float32).repeat_interleave(2))
    return batch


class RewardPairDataset(Dataset):
    """Reward-model training pairs (module docstring); :meth:`collate` builds a schema batch.

    Args:
        source: A ``.jsonl`` / ``.parquet`` file (or a cached hub dataset id), or its rows.
        tokenizer: The reward model's tokenizer.
        max_length: Longest prompt + completion + the score token, in tokens.

    Raises:
        ValueError: A bad row (named by file and row), or a margin on some rows only.
    """

    def __init__(self, source: str | Path | Sequence[Any], tokenizer: PreTrainedTokenizerBase,
                 max_length: int = 512) -> None:
        rows = read_rows(Path(source)) if isinstance(source, (str, Path)) else list(source)
        file = f"{source}: " if isinstance(source, (str, Path)) else ""
        self.pairs = [encode_reward_pair(r, tokenizer, max_length, f"{file}row {i}: ")
                      for i, r in enumerate(rows)]
        with_margin = [p.margin is not None for p in self.pairs]
        if any(with_margin) and not all(with_margin):
            raise ValueError(f"{file}row {with_margin.index(not with_margin[0])}: 'margin' is given on some "
                             "rows and not others; give every row one (0 for none)")
        self.extra_id = extra_token_id(tokenizer)
        self.pad_token_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> RewardPair:
        return self.pairs[i]

    def collate(self, items: Sequence[RewardPair]) -> TensorDict:
        """Schema batch of ``items`` (:func:`collate_reward_pairs`)."""
        return collate_reward_pairs(items, self.extra_id, self.pad_token_id)
