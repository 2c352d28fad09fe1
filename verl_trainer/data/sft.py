"""SFT data, one home: datasets of pairs or chats, in memory or streamed, and their collation.

:class:`SFTDataset` (in memory), :class:`IterableSFTDataset` (a stream of rows), :func:`collate_sft` (schema
batch).

A dataset is built from an SFT file (``.jsonl`` / ``.parquet``), from rows (a list, or a
``datasets.Dataset``), or from examples that are already token ids. A row is one of TRL's SFT formats
(standard or conversational), or verl's pair:

* a pair: ``prompt`` and ``response`` columns (names configurable: ``prompt_key``, ``response_key``;
  TRL's ``completion`` is the response when the row has no ``response_key`` column); the prompt is
  encoded as the RL prompt dataset encodes it, the response gets the eos appended, and the loss covers
  the response (eos included);
* a conversational prompt-completion (TRL): ``prompt`` and ``completion`` are both message lists; the
  whole conversation goes through the chat template and the loss covers the completion's tokens
  (:func:`encode_chat_completion`);
* a chat: a ``messages`` column (``messages_key``) with a multi-turn list of ``{"role", "content"}``
  (TRL's conversational language modelling). It goes through the tokenizer's chat template and the loss
  covers the assistant turns only (:func:`encode_chat_example`);
* plain text (TRL's standard language modelling): a ``text`` column; the eos is appended and the loss
  covers every token.

Anything else (a prompt-only row, preference rows with ``chosen`` / ``rejected``, a list completion after a
string prompt, a completion that is neither text nor messages) is refused, naming the row and the formats.

:func:`collate_sft` turns examples into a schema batch ``[B, T]``; every sample is its own uid.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from tensordict import TensorDict
from torch.utils.data import Dataset, IterableDataset

from verl_trainer.data import schema
from verl_trainer.data.packing import make_batch
from verl_trainer.data.prompts import encode_prompt, read_rows
from verl_trainer.data.vlm_sft import VisionSFTExample, collate_vision_sft, encode_vision_sft_row

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from verl_trainer.data.vlm_processor import VisionProcessor

__all__ = [
    "IterableSFTDataset", "SFTDataset", "TokenMask", "TokenPair", "collate_sft", "encode_chat_completion",
    "encode_chat_example", "encode_sft_example",
]

TokenPair = tuple[list[int], list[int]]
"""``(prompt_ids, response_ids)`` of one SFT sample."""


class TokenMask(NamedTuple):
    """One SFT sample as token ids and a per-token loss mask (a chat: 1 on the assistant turns)."""

    ids: list[int]
    loss_mask: list[int]


SFTExample = TokenPair | TokenMask
"""What an SFT dataset item is (with images: :class:`verl_trainer.data.vlm_sft.VisionSFTExample`)."""

ChatRenderer = Callable[[Sequence[Mapping[str, Any]], bool], list[int]]
"""``(messages, add_generation_prompt) -> token ids`` of a chat (see :func:`encode_chat_example`)."""


def encode_sft_example(tokenizer: PreTrainedTokenizerBase, prompt: str | list[dict[str, str]], response: str,
                       chat_template: bool | None = None) -> TokenPair:
    """Token ids of one SFT example: prompt as the RL prompt dataset encodes it, response + eos.

    Returns:
        ``(prompt_ids, response_ids)``.
    """
    prompt_ids = encode_prompt(tokenizer, prompt, chat_template)
    response_ids = list(tokenizer.encode(response, add_special_tokens=False)) + [int(tokenizer.eos_token_id)]
    return prompt_ids, response_ids


def encode_chat_example(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, str]],
                        where: str = "", render_ids: ChatRenderer | None = None) -> TokenMask:
    """Token ids of a multi-turn chat with the loss on the assistant turns only.

    Each assistant turn's tokens are what the chat template adds for that message after the conversation
    before it with the generation prompt (``apply_chat_template(messages[:i], add_generation_prompt=True)``
    → ``apply_chat_template(messages[:i + 1])``): the turn's content and its end-of-turn tokens, not the
    role header. The template must render each prefix of the conversation as a prefix of the whole.
    ``render_ids(messages, add_generation_prompt)`` renders and tokenises (default: the tokenizer's chat
    template; a chat with images: :meth:`verl_trainer.data.vlm_processor.VisionProcessor.chat_ids`).

    Raises:
        ValueError: No chat template, a malformed message, no assistant turn, or a template that does not
            render prefixes as prefixes (e.g. one that rewrites earlier turns).
    """
    _check_messages(tokenizer, messages, where)
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}the chat has no assistant turn to train on (roles: "
                         f"{[m['role'] for m in messages]})")

    def render(upto: int, generation_prompt: bool) -> list[int]:
        if render_ids is not None:
            return render_ids(messages[:upto], generation_prompt) if upto else []
        return _render(tokenizer, messages[:upto], generation_prompt)

    ids = render(len(messages), False)
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, end = len(render(i, True)), len(render(i + 1, False))
        if ids[:end] != render(i + 1, False) or render(i, True) != ids[:start]:
            raise ValueError(
                f"{where}the chat template does not render the conversation up to turn {i} as a prefix of "
                "the whole, so the assistant tokens cannot be located; use a template without rewriting of "
                "earlier turns, or split the chat into prompt/response rows"
            )
        mask[start:end] = [1] * (end - start)
    return TokenMask(ids, mask)


def _check_messages(tokenizer: PreTrainedTokenizerBase, messages: Any, where: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{where}a conversational row needs a tokenizer with a chat_template; set one "
                         "(tokenizer.chat_template = ...) or give text columns")
    for j, m in enumerate(messages):
        if not isinstance(m, Mapping) or not {"role", "content"} <= set(m):
            raise ValueError(f"{where}message {j} must be a mapping with 'role' and 'content', got {m!r}")


def _render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, str]],
            generation_prompt: bool) -> list[int]:
    """Token ids of ``messages`` through the chat template (no messages: none)."""
    if not messages:
        return []
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt,
                                         tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_chat_completion(tokenizer: PreTrainedTokenizerBase, prompt: Sequence[Mapping[str, str]],
                           completion: Sequence[Mapping[str, str]], where: str = "",
                           render_ids: ChatRenderer | None = None) -> TokenMask:
    """Token ids of TRL's conversational prompt-completion, with the loss on the completion only.

    The conversation ``prompt + completion`` goes through the chat template; the completion's tokens are
    what follows the prompt rendered with the generation prompt (so the assistant header is not trained),
    its end-of-turn tokens included. ``render_ids``: as for :func:`encode_chat_example`.

    Raises:
        ValueError: No chat template, a malformed message, an empty completion, or a template that does not
            render the prompt as a prefix of the whole conversation.
    """
    _check_messages(tokenizer, [*prompt, *completion], where)
    if not completion:
        raise ValueError(f"{where}the completion is an empty message list; nothing to train on")
    def render(messages: Sequence[Mapping[str, str]], generation_prompt: bool) -> list[int]:
        if render_ids is not None:
            return render_ids(messages, generation_prompt)
        return _render(tokenizer, messages, generation_prompt)

    ids = render([*prompt, *completion], False)
    head = render(prompt, True)
    if ids[:len(head)] != head or len(head) >= len(ids):
        raise ValueError(
            f"{where}the chat template does not render the prompt (with the generation prompt) as a prefix "
            "of the conversation, so the completion's tokens cannot be located; use a template that does, "
            "or give the conversation as one 'messages' list"
        )
    return TokenMask(ids, [0] * len(head) + [1] * (len(ids) - len(head)))


def _is_messages(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(m, Mapping) for m in value)


def _encode_text_row(item: Mapping[str, Any], keys: tuple[str, str, str],
                     tokenizer: PreTrainedTokenizerBase,
                     chat_template: bool | None, where: str) -> SFTExample:
    """One text row in one of the formats of the module docstring (not yet length-checked)."""
    prompt_key, response_key, messages_key = keys
    if item.get(messages_key) is not None:
        return encode_chat_example(tokenizer, item[messages_key], where)
    completion_key = response_key if response_key in item else "completion"
    if prompt_key in item and completion_key in item:
        prompt, completion = item[prompt_key], item[completion_key]
        if _is_messages(prompt) and _is_messages(completion):
            return encode_chat_completion(tokenizer, prompt, completion, where)
        if isinstance(completion, (str, int, float)) and (isinstance(prompt, str) or _is_messages(prompt)):
            return encode_sft_example(tokenizer, prompt, str(completion), chat_template)
        raise ValueError(
            f"{where}{prompt_key!r} is {type(prompt).__name__} and {completion_key!r} is "
            f"{type(completion).__name__}: give both as text (standard) or both as message lists "
            "(conversational), or a string completion after a message-list prompt"
        )
    if isinstance(item.get("text"), str):
        ids = list(tokenizer.encode(item["text"], add_special_tokens=False)) + [int(tokenizer.eos_token_id)]
        return TokenMask(ids, [1] * len(ids))
    kind = ("preference data (chosen/rejected) is for preference training, not SFT; "
            if {"chosen", "rejected"} <= set(item) else
            "a prompt-only row has nothing to train on (it is RL data); " if prompt_key in item else "")
    raise ValueError(
        f"{where}{kind}an SFT row needs {prompt_key!r} and {response_key!r} (or 'completion') columns, a "
        f"{messages_key!r} column (a chat) or a 'text' column; it has {sorted(item)} — set prompt_key / "
        "response_key / messages_key to your column names"
    )


def _is_token_pair(item: Any) -> bool:
    return isinstance(item, (tuple, list)) and len(item) == 2 and not isinstance(item, Mapping)


def encode_sft_row(item: Any, i: int, tokenizer: PreTrainedTokenizerBase | None, max_length: int,
                   chat_template: bool | None = None,
                   keys: tuple[str, str, str] = ("prompt", "response", "messages"),
                   where: str = "", processor: VisionProcessor | None = None,
                   image_key: str | None = None) -> SFTExample | VisionSFTExample:
    """One SFT example from a row (pair or chat), a ``TokenMask`` or an id pair (see the module docstring).

    Args:
        item: The row.
        i: Its index (for messages).
        tokenizer: Tokenizer of text rows.
        max_length: Longest example in tokens.
        chat_template: See :func:`verl_trainer.data.prompts.encode_prompt` (pair rows).
        keys: ``(prompt_key, response_key, messages_key)`` column names.
        where: Prefix of messages (the file).
        processor: Encodes rows with images (:mod:`verl_trainer.data.vlm_sft`); ``None``: such a row raises.
        image_key: The image column (default: ``images``, else ``image``).

    Raises:
        ValueError: A text row without a tokenizer, without the columns, or longer than ``max_length``.
    """
    if isinstance(item, VisionSFTExample):
        return item
    if isinstance(item, TokenMask):
        return TokenMask(list(item.ids), list(item.loss_mask))
    if _is_token_pair(item):
        return list(item[0]), list(item[1])
    tokenizer = tokenizer if tokenizer is not None or processor is None else processor.tokenizer
    if tokenizer is None:
        raise ValueError(f"{where}SFT row {i} is text: pass tokenizer= to tokenise it, or give id pairs")
    if not isinstance(item, Mapping):
        raise ValueError(f"{where}SFT row {i} must be a mapping of columns, got {type(item).__name__}")
    vision = encode_vision_sft_row(item, processor, chat_template, keys, f"{where}SFT row {i}: ",
                                   (encode_chat_example, encode_chat_completion), image_key)
    example = vision.example if vision else _encode_text_row(item, keys, tokenizer, chat_template,
                                                             f"{where}SFT row {i}: ")
    length = len(example.ids) if isinstance(example, TokenMask) else len(example[0]) + len(example[1])
    if length > max_length:
        raise ValueError(
            f"{where}SFT row {i} has {length} tokens > max_length={max_length}; raise data.max_length or "
            "shorten the row"
        )
    return vision or example


class SFTDataset(Dataset):
    """SFT examples (pairs or chats, see the module docstring); :meth:`collate` builds a schema batch.

    Args:
        source: An SFT file (or a hub dataset id in the local HF cache: ``org/name[:config][@split]``, see
            :mod:`verl_trainer.data.hub`), its rows, or examples already tokenised (``(prompt_ids,
            response_ids)`` pairs or :class:`TokenMask` values; then no tokenizer is needed).
        tokenizer: A transformers tokenizer with an eos token (for files and rows).
        max_length: Longest example in tokens; longer rows raise.
        chat_template: See :func:`verl_trainer.data.prompts.encode_prompt` (pair rows).
        pad_token_id: Padding id of :meth:`collate` (default: the tokenizer's, else 0).
        prompt_key: Column of the prompt (pair rows).
        response_key: Column of the response (pair rows).
        messages_key: Column of a multi-turn chat (chat rows; takes precedence when present).
        processor: A vision-language model's :class:`~verl_trainer.data.vlm_processor.VisionProcessor`:
            rows with images (:mod:`verl_trainer.data.vlm_sft`) become examples whose batches carry
            ``pixel_values`` / ``image_grid_thw``; ``None``: a row with images raises.
        image_key: The image column (default: ``images``, else ``image``).

    Raises:
        ValueError: A row without the columns, longer than ``max_length``, or text rows without a tokenizer.
    """

    def __init__(self, source: str | Path | Sequence[Any], tokenizer: PreTrainedTokenizerBase | None = None,
                 max_length: int = 512, chat_template: bool | None = None, pad_token_id: int | None = None,
                 prompt_key: str = "prompt", response_key: str = "response",
                 messages_key: str = "messages", processor: VisionProcessor | None = None,
                 image_key: str | None = None) -> None:
        items = read_rows(Path(source)) if isinstance(source, (str, Path)) else list(source)
        where = f"{source}: " if isinstance(source, (str, Path)) else ""
        self.pad_token_id = _pad_id(tokenizer, pad_token_id)
        keys = (prompt_key, response_key, messages_key)
        self.examples: list[SFTExample | VisionSFTExample] = [
            encode_sft_row(item, i, tokenizer, max_length, chat_template, keys, where, processor, image_key)
            for i, item in enumerate(items)
        ]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> SFTExample:
        return self.examples[i]

    def collate(self, items: Sequence[SFTExample]) -> TensorDict:
        """Schema batch of ``items`` with this dataset's padding id (see :func:`collate_sft`)."""
        return collate_sft(items, self.pad_token_id)


def _pad_id(tokenizer: PreTrainedTokenizerBase | None, pad_token_id: int | None) -> int:
    if pad_token_id is None:
        pad_token_id = getattr(tokenizer, "pad_token_id", None)
    return int(pad_token_id or 0)


class IterableSFTDataset(IterableDataset):
    """A stream of SFT rows (e.g. ``datasets.load_dataset(..., streaming=True)``), tokenised as they come.

    The Trainer shards it over the data-parallel ranks by position (rank ``r`` of ``dp`` takes rows
    ``r, r + dp, ...``, batched by the DataLoader), every rank steps while all ranks still have a batch,
    and a resumed run skips the batches it consumed. Columns and errors as :class:`SFTDataset`.

    Args:
        rows: An iterable of rows (re-iterated every epoch).
        tokenizer, max_length, chat_template, pad_token_id, prompt_key, response_key, messages_key,
            processor, image_key: As for :class:`SFTDataset`.
    """

    def __init__(self, rows: Iterable[Any], tokenizer: PreTrainedTokenizerBase | None = None,
                 max_length: int = 512, chat_template: bool | None = None, pad_token_id: int | None = None,
                 prompt_key: str = "prompt", response_key: str = "response",
                 messages_key: str = "messages", processor: VisionProcessor | None = None,
                 image_key: str | None = None) -> None:
        self.processor, self.image_key = processor, image_key
        self.rows = rows
        self.tokenizer, self.max_length, self.chat_template = tokenizer, max_length, chat_template
        self.keys = (prompt_key, response_key, messages_key)
        self.pad_token_id = _pad_id(tokenizer, pad_token_id)
        self.shard: tuple[int, int] = (0, 1)  # (rank, num_shards), set by the Trainer

    def __iter__(self) -> Iterator[SFTExample]:
        rank, shards = self.shard
        for i, item in enumerate(self.rows):
            if i % shards == rank:
                yield encode_sft_row(item, i, self.tokenizer, self.max_length, self.chat_template, self.keys,
                                     processor=self.processor, image_key=self.image_key)

    def collate(self, items: Sequence[SFTExample]) -> TensorDict:
        """Schema batch of ``items`` (see :func:`collate_sft`)."""
        return collate_sft(items, self.pad_token_id)


def collate_sft(items: Sequence[SFTExample], pad_token_id: int = 0) -> TensorDict:
    """Batch SFT examples into a schema ``TensorDict`` ``[B, T]``.

    ``loss_mask`` is 1 on the response tokens of ``(prompt_ids, response_ids)`` pairs and follows the mask of
    :class:`TokenMask` examples (position 0 never: it has no prediction); every sample is its own uid.
    Examples with images add ``pixel_values`` ``[B, P, D]`` and ``image_grid_thw`` ``[B, I, 3]``.
    """
    items, vision = collate_vision_sft(items)
    prompts = [[] if isinstance(it, TokenMask) else list(it[0]) for it in items]
    responses = [list(it.ids) if isinstance(it, TokenMask) else list(it[1]) for it in items]
    batch = make_batch(prompts, responses, uids=torch.arange(len(items)), pad_token_id=pad_token_id)
    masked = [i for i, it in enumerate(items) if isinstance(it, TokenMask)]
    if masked:
        loss = batch[schema.LOSS_MASK].clone()
        for i in masked:
            row = torch.tensor(items[i].loss_mask, dtype=loss.dtype)
            loss[i] = 0.0
            loss[i, 1:row.numel()] = row[1:]
        batch[schema.LOSS_MASK] = loss
        batch[schema.RESPONSE_MASK] = loss.clone()
    batch.update(vision)
    return batch
