"""Observation tokens through the chat template: what the template adds after an assistant turn.

The rollout never re-tokenises the conversation: the model's tokens stay as sampled, and only the new
messages (tool results, environment observations) are rendered and encoded, as the text the chat
template puts between the end of the last assistant message and the next assistant turn's start.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["ObservationEncoder"]

_SENTINEL = "\u2063ASSISTANT_END\u2063"


class ObservationEncoder:
    """Encodes observation messages as the tokens that follow an assistant turn.

    Args:
        tokenizer: The policy's tokenizer, with a chat template that renders the roles used (``tool``,
            ``user``).
        eos_token_ids: Ids that end a model turn (their text is not repeated when the template writes it
            after the assistant's content: the model already sampled it).

    Raises:
        ValueError: The tokenizer has no chat template.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: Sequence[int]) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("multi-turn rollouts render tool results through the tokenizer's chat template, "
                             "and this tokenizer has none; set tokenizer.chat_template (one that renders "
                             "role 'tool') in the checkpoint")
        self.tokenizer = tokenizer
        self.eos_texts = [t for t in (tokenizer.decode([i]) for i in eos_token_ids) if t]

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def text(self, messages: list[dict[str, Any]]) -> str:
        """The text the template writes after an assistant turn for ``messages``, to the next turn's start.

        Raises:
            ValueError: The template rewrites earlier turns when messages follow (not append-only).
        """
        base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _SENTINEL}]
        before = self._render(base, False)
        after = self._render(base + list(messages), True)
        if not after.startswith(before):
            raise ValueError("the chat template renders the conversation differently once tool / user "
                             "follow an assistant turn; multi-turn rollouts need an append-only template")
        trailer = before[before.rfind(_SENTINEL) + len(_SENTINEL):]
        for eos in self.eos_texts:  # the model sampled the turn's end token itself
            if trailer.startswith(eos):
                trailer = trailer[len(eos):]
                break
        return trailer + after[len(before):]

    def encode(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of :meth:`text` (no special tokens added)."""
        return list(self.tokenizer.encode(self.text(messages), add_special_tokens=False))
