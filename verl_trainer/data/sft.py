"""SFT data, one home: :class:`SFTDataset` (prompt/response pairs) and :func:`collate_sft` (schema batch).

A dataset is built from an SFT file (``.jsonl`` / ``.parquet`` with ``prompt`` and ``response``; the
prompt is encoded as the RL prompt dataset encodes it, the response gets the eos appended), from such
rows, or from pairs that are already token ids. :func:`collate_sft` turns pairs into a schema batch
``[B, T]`` whose ``loss_mask`` covers the response tokens (eos included); every sample is its own uid.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict
from torch.utils.data import Dataset

from verl_trainer.data.packing import make_batch
from verl_trainer.data.prompts import encode_prompt, read_rows

__all__ = ["SFTDataset", "TokenPair", "collate_sft", "encode_sft_example"]

TokenPair = tuple[list[int], list[int]]
"""``(prompt_ids, response_ids)`` of one SFT sample."""


def encode_sft_example(tokenizer: Any, prompt: str | list[dict[str, str]], response: str,
                       chat_template: bool | None = None) -> TokenPair:
    """Token ids of one SFT example: prompt as the RL prompt dataset encodes it, response + eos.

    Returns:
        ``(prompt_ids, response_ids)``.
    """
    prompt_ids = encode_prompt(tokenizer, prompt, chat_template)
    response_ids = list(tokenizer.encode(response, add_special_tokens=False)) + [int(tokenizer.eos_token_id)]
    return prompt_ids, response_ids


def _is_token_pair(item: Any) -> bool:
    return isinstance(item, (tuple, list)) and len(item) == 2 and not isinstance(item, Mapping)


class SFTDataset(Dataset):
    """Prompt/response pairs for SFT; :meth:`collate` builds a schema batch.

    Args:
        source: An SFT file, its rows (``{"prompt", "response"}`` mappings), or ``(prompt_ids,
            response_ids)`` pairs already tokenised (then no tokenizer is needed).
        tokenizer: A transformers tokenizer with an eos token (for files and rows).
        max_length: Longest prompt + response of a row; longer rows raise.
        chat_template: See :func:`verl_trainer.data.prompts.encode_prompt`.
        pad_token_id: Padding id of :meth:`collate` (default: the tokenizer's, else 0).

    Raises:
        ValueError: A row without ``prompt``/``response``, longer than ``max_length``, or rows without a
            tokenizer.
    """

    def __init__(self, source: str | Path | Sequence[Mapping[str, Any]] | Sequence[Sequence[Sequence[int]]],
                 tokenizer: Any = None, max_length: int = 512, chat_template: bool | None = None,
                 pad_token_id: int | None = None) -> None:
        items = read_rows(Path(source)) if isinstance(source, (str, Path)) else list(source)
        where = f"{source}: " if isinstance(source, (str, Path)) else ""
        if pad_token_id is None:
            pad_token_id = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad_token_id or 0)
        self.examples: list[TokenPair] = []
        for i, item in enumerate(items):
            if _is_token_pair(item):
                self.examples.append((list(item[0]), list(item[1])))
                continue
            if tokenizer is None:
                raise ValueError(
                    f"{where}SFT row {i} is text: pass tokenizer= to tokenise it, or give id pairs"
                )
            if "prompt" not in item or "response" not in item:
                raise ValueError(
                    f"{where}SFT row {i} needs 'prompt' and 'response' columns; it has {sorted(item)}"
                )
            p, r = encode_sft_example(tokenizer, item["prompt"], str(item["response"]), chat_template)
            if len(p) + len(r) > max_length:
                raise ValueError(
                    f"{where}SFT row {i} has {len(p) + len(r)} tokens > max_length={max_length}; raise "
                    "data.max_length or shorten the row"
                )
            self.examples.append((p, r))

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> TokenPair:
        return self.examples[i]

    def collate(self, items: Sequence[TokenPair]) -> TensorDict:
        """Schema batch of ``items`` with this dataset's padding id (see :func:`collate_sft`)."""
        return collate_sft(items, self.pad_token_id)


def collate_sft(items: Sequence[tuple[Sequence[int], Sequence[int]]], pad_token_id: int = 0) -> TensorDict:
    """Batch ``(prompt_ids, response_ids)`` pairs into a schema ``TensorDict`` ``[B, T]``.

    ``loss_mask`` is 1 on the response tokens; every sample is its own uid.
    """
    prompts = [list(p) for p, _ in items]
    responses = [list(r) for _, r in items]
    return make_batch(prompts, responses, uids=torch.arange(len(items)), pad_token_id=pad_token_id)
