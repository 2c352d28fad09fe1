"""Preference data: TRL's preference and unpaired formats, tokenised, and their schema batches.

A row is one of (column names as TRL's):

* explicit prompt: ``{"prompt", "chosen", "rejected"}``, text or conversational (the prompt a message list,
  ``chosen`` / ``rejected`` assistant message lists);
* implicit prompt: ``{"chosen", "rejected"}`` that share a prefix: the prompt is their longest common
  prefix (characters of text, a space before the split staying with the completions; the leading common
  messages of conversations), as TRL's ``extract_prompt``;
* verl's layout (``.parquet`` / ``.jsonl``): a chat-list ``prompt`` with text ``chosen`` / ``rejected``; other
  columns (``data_source``, ``reward_model``, ``extra_info``, ...) are ignored;
* unpaired (KTO): ``{"prompt", "completion", "label"}`` (``label`` a bool: desirable or not), text or
  conversational. A KTO dataset may also be given paired rows: each becomes a desirable and an undesirable
  example, as TRL's ``unpair_preference_dataset``.

Encoding: a text prompt is encoded as the RL and SFT prompts are
(:func:`~verl_trainer.data.prompts.encode_prompt`) and a text completion gets the eos appended (TRL:
``add_eos``); a conversation goes through the chat template and its completion is what follows the prompt
rendered with the generation prompt
(:func:`~verl_trainer.data.sft.encode_chat_completion`). A bad row (missing columns, mixed text and messages,
no shared prefix, an empty completion, longer than ``max_length``) is a ``ValueError`` naming the row.

Batches (:func:`collate_pairs`, :func:`collate_unpaired`) are schema batches (``verl_trainer.data.schema``):
a pair is two rows with one ``group_id`` (``preferred`` 1 the chosen, 0 the rejected); an unpaired example is
its row and its KL row (``kl_sample=True``: its prompt with the completion of another example, TRL's
rotation by one within chunks of ``kl_chunk_size`` rows in dataset order), sharing a ``group_id``.
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
from verl_trainer.data.prompts import encode_prompt, read_rows
from verl_trainer.data.sft import encode_chat_completion

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "PairExample", "PreferenceDataset", "UnpairedExample", "collate_pairs", "collate_unpaired",
    "encode_preference_row", "extract_prompt",
]


class PairExample(NamedTuple):
    """A tokenised preference pair."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]


class UnpairedExample(NamedTuple):
    """A tokenised unpaired (KTO) example; ``kl_ids`` is the mismatched completion of its KL row."""

    prompt_ids: list[int]
    completion_ids: list[int]
    desirable: bool
    kl_ids: list[int]


def _is_messages(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(m, Mapping) for m in value)


def extract_prompt(chosen: Any, rejected: Any, where: str = "") -> tuple[Any, Any, Any]:
    """``(prompt, chosen, rejected)`` of an implicit-prompt pair: the longest common prefix is the prompt.

    Text: characters, a space just before the split going with the completions; conversations: the
    leading messages both share (TRL's ``extract_prompt``).

    Raises:
        ValueError: No common prefix, or one completion is a prefix of the other (nothing left).
    """
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise ValueError(f"{where}'chosen' and 'rejected' must both be text or both message lists")
    idx = 0
    limit = min(len(chosen), len(rejected))
    while idx < limit and chosen[idx] == rejected[idx]:
        idx += 1
    if isinstance(chosen, str) and 0 < idx < limit and chosen[idx - 1] == " ":
        idx -= 1
    if idx == 0 or idx >= len(chosen) or idx >= len(rejected):
        raise ValueError(
            f"{where}an implicit-prompt pair needs 'chosen' and 'rejected' to share a prompt prefix and then "
            f"differ ({idx} shared of {len(chosen)} and {len(rejected)}); give a 'prompt' column instead"
        )
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _completion(tokenizer: PreTrainedTokenizerBase, prompt: Any, completion: Any, chat_template: bool | None,
                name: str, where: str) -> tuple[list[int], list[int]]:
    """``(prompt_ids, completion_ids)`` of one prompt and completion (module docstring)."""
    if _is_messages(completion):
        if not _is_messages(prompt):
            raise ValueError(f"{where}{name!r} is a message list but 'prompt' is not; give both as messages")
        ids, mask = encode_chat_completion(tokenizer, list(prompt), list(completion), where)
        start = mask.index(1)
        return ids[:start], ids[start:]
    if not isinstance(completion, str):
        raise ValueError(f"{where}{name!r} must be text or a message list, got {type(completion).__name__}")
    if not (isinstance(prompt, str) or _is_messages(prompt)):
        raise ValueError(f"{where}'prompt' must be text or a message list, got {type(prompt).__name__}")
    ids = list(tokenizer.encode(completion, add_special_tokens=False)) + [int(tokenizer.eos_token_id)]
    return encode_prompt(tokenizer, prompt, chat_template), ids


def _check_length(where: str, max_length: int, prompt: list[int], *completions: list[int]) -> None:
    for ids in completions:
        if len(prompt) + len(ids) > max_length:
            raise ValueError(f"{where}{len(prompt) + len(ids)} tokens > max_length={max_length}; raise "
                             "data.max_length or shorten the row")


def encode_preference_row(item: Any, tokenizer: PreTrainedTokenizerBase, max_length: int,
                          chat_template: bool | None = None,
                          where: str = "") -> PairExample | UnpairedExample:
    """One row (module docstring): a :class:`PairExample`, or an :class:`UnpairedExample` (``kl_ids`` empty).

    Raises:
        ValueError: A row in none of the formats, or one that does not encode (module docstring).
    """
    if not isinstance(item, Mapping):
        raise ValueError(f"{where}must be a mapping of columns, got {type(item).__name__}")
    if "chosen" in item and "rejected" in item:
        if item.get("prompt") is not None:
            prompt, chosen, rejected = item["prompt"], item["chosen"], item["rejected"]
        else:
            prompt, chosen, rejected = extract_prompt(item["chosen"], item["rejected"], where)
        prompt_ids, chosen_ids = _completion(tokenizer, prompt, chosen, chat_template, "chosen", where)
        prompt_r, rejected_ids = _completion(tokenizer, prompt, rejected, chat_template, "rejected", where)
        if prompt_r != prompt_ids:
            raise ValueError(f"{where}the prompt encodes differently before 'chosen' and 'rejected'")
        _check_length(where, max_length, prompt_ids, chosen_ids, rejected_ids)
        return PairExample(prompt_ids, chosen_ids, rejected_ids)
    if {"prompt", "completion", "label"} <= set(item):
        label = item["label"]
        if not isinstance(label, (bool, int)) or label not in (0, 1):
            raise ValueError(f"{where}'label' must be true or false (desirable or not), got {label!r}")
        prompt_ids, ids = _completion(tokenizer, item["prompt"], item["completion"], chat_template,
                                      "completion", where)
        _check_length(where, max_length, prompt_ids, ids)
        return UnpairedExample(prompt_ids, ids, bool(label), [])
    raise ValueError(
        f"{where}a preference row needs 'prompt', 'chosen' and 'rejected' (or 'chosen' and 'rejected' "
        "sharing the prompt as a prefix), or an unpaired row 'prompt', 'completion' and 'label'; it has "
        f"{sorted(item)}"
    )


def _with_kl(examples: list[UnpairedExample], chunk: int) -> list[UnpairedExample]:
    """Each example's KL completion: the completions rotated by one within chunks of ``chunk`` examples."""
    out = []
    for start in range(0, len(examples), chunk):
        part = examples[start:start + chunk]
        rotated = [part[-1].completion_ids] + [e.completion_ids for e in part[:-1]]
        out += [e._replace(kl_ids=list(kl)) for e, kl in zip(part, rotated)]
    return out


class PreferenceDataset(Dataset):
    """Preference pairs or unpaired examples (module docstring); :meth:`collate` builds a schema batch.

    Args:
        source: A ``.jsonl`` / ``.parquet`` file (or a cached hub dataset id), or its rows.
        tokenizer: A transformers tokenizer with an eos token.
        max_length: Longest prompt + completion in tokens; a longer row raises.
        unpaired: ``False``: pairs (DPO and its variants; unpaired rows are refused); ``True``: unpaired
            examples (KTO; pairs are unpaired into a desirable and an undesirable example).
        kl_chunk_size: Unpaired: the KL completions rotate within chunks of this many examples (TRL: the
            per-device batch; the recipes pass the global ``data.train_batch_size``).
        chat_template: See :func:`~verl_trainer.data.prompts.encode_prompt` (text prompts).
        pad_token_id: Padding id of :meth:`collate` (default: the tokenizer's, else 0).

    Raises:
        ValueError: A bad row (named by file and row), or pairs and unpaired rows in one pair dataset.
    """

    def __init__(self, source: str | Path | Sequence[Any], tokenizer: PreTrainedTokenizerBase,
                 max_length: int = 512, unpaired: bool = False, kl_chunk_size: int = 8,
                 chat_template: bool | None = None, pad_token_id: int | None = None) -> None:
        rows = read_rows(Path(source)) if isinstance(source, (str, Path)) else list(source)
        file = f"{source}: " if isinstance(source, (str, Path)) else ""
        self.unpaired = unpaired
        self.pad_token_id = int(pad_token_id if pad_token_id is not None else tokenizer.pad_token_id or 0)
        examples: list[PairExample | UnpairedExample] = []
        for i, row in enumerate(rows):
            example = encode_preference_row(row, tokenizer, max_length, chat_template, f"{file}row {i}: ")
            if isinstance(example, UnpairedExample) and not unpaired:
                raise ValueError(f"{file}row {i}: an unpaired row (prompt, completion, label) in pair data; "
                                 "pair losses need 'chosen' and 'rejected' (use loss_type=kto for unpaired "
                                 "data)")
            if isinstance(example, PairExample) and unpaired:
                examples += [UnpairedExample(example.prompt_ids, example.chosen_ids, True, []),
                             UnpairedExample(example.prompt_ids, example.rejected_ids, False, [])]
            else:
                examples.append(example)
        if unpaired:
            if kl_chunk_size < 2:
                raise ValueError(f"kl_chunk_size={kl_chunk_size}: KTO's KL rows rotate completions within "
                                 "chunks, which needs at least 2 examples (TRL refuses a batch size of 1)")
            examples = _with_kl(examples, kl_chunk_size)  # type: ignore[arg-type]
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> PairExample | UnpairedExample:
        return self.examples[i]

    def collate(self, items: Sequence[Any]) -> TensorDict:
        """Schema batch of ``items`` (:func:`collate_unpaired` or :func:`collate_pairs`)."""
        return (collate_unpaired if self.unpaired else collate_pairs)(items, self.pad_token_id)


def _batch(prompts: list[list[int]], completions: list[list[int]], groups: list[int], preferred: list[float],
           pad_token_id: int) -> TensorDict:
    batch = make_batch(prompts, completions, pad_token_id=pad_token_id)
    batch.set(schema.GROUP_ID, torch.tensor(groups, dtype=torch.long))
    batch.set(schema.PREFERRED, torch.tensor(preferred, dtype=torch.float32))
    return batch


def collate_pairs(items: Sequence[PairExample], pad_token_id: int = 0) -> TensorDict:
    """Schema batch ``[2P, T]`` of ``P`` pairs: row ``2p`` chosen, ``2p + 1`` rejected, ``group_id = p``."""
    prompts = [list(e.prompt_ids) for e in items for _ in (0, 1)]
    completions = [list(ids) for e in items for ids in (e.chosen_ids, e.rejected_ids)]
    groups = [p for p in range(len(items)) for _ in (0, 1)]
    return _batch(prompts, completions, groups, [1.0, 0.0] * len(items), pad_token_id)


def collate_unpaired(items: Sequence[UnpairedExample], pad_token_id: int = 0) -> TensorDict:
    """Schema batch ``[2N, T]``: example ``i`` at row ``2i``, its KL row (``kl_sample``) at ``2i + 1``."""
    prompts = [list(e.prompt_ids) for e in items for _ in (0, 1)]
    completions = [list(ids) for e in items for ids in (e.completion_ids, e.kl_ids)]
    groups = [i for i in range(len(items)) for _ in (0, 1)]
    preferred = [v for e in items for v in (float(e.desirable), 0.0)]
    batch = _batch(prompts, completions, groups, preferred, pad_token_id)
    batch.set(schema.KL_SAMPLE, torch.tensor([False, True] * len(items)))
    return batch
