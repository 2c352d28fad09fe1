"""The request bodies the token server accepts (OpenAI's fields, plus token ids and a trajectory tag).

Both endpoints take ``max_tokens`` (chat: or ``max_completion_tokens``), ``temperature``, ``top_p``,
``top_k`` (vLLM's extension), ``n``, ``seed`` and ``trajectory_id`` (or the ``X-Trajectory-Id`` header).
``/v1/completions`` takes one prompt, as text or as token ids; ``/v1/chat/completions`` takes ``messages``
with text content (a string or ``{"type": "text"}`` parts) and optional ``tools`` (rendered by the chat
template). Unknown fields are ignored as OpenAI clients send many; fields whose meaning the server cannot
honour (``stop``, ``logit_bias``, ``stream``, ...) are refused with a 400 naming them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ChatRequest", "CompletionRequest", "RequestError", "UNSUPPORTED_FIELDS", "message_text"]

UNSUPPORTED_FIELDS = ("stop", "logit_bias", "stream", "best_of", "echo", "suffix", "presence_penalty",
                      "frequency_penalty", "response_format")
"""Fields refused when set to a non-default value: the server would otherwise answer with tokens that do
not follow them (or, for ``stop``, train tokens the client never saw)."""


class RequestError(Exception):
    """A bad request: answered with ``status`` and an OpenAI-style error body naming ``param``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    n: int = Field(default=1, ge=1)
    seed: int | None = None
    trajectory_id: str | None = None
    logprobs: Any = None
    stop: Any = None
    logit_bias: Any = None
    stream: Any = None
    best_of: Any = None
    echo: Any = None
    suffix: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    response_format: Any = None

    def check_supported(self) -> None:
        """Raise :class:`RequestError` (400) naming a set field the server cannot honour."""
        for key in UNSUPPORTED_FIELDS:
            value = getattr(self, key)
            if value not in (None, False, 0, 0.0, [], "") and not (key == "best_of" and value == 1):
                raise RequestError(400, f"{key}={value!r} is not supported by the token server (it returns "
                                   f"exactly the sampled tokens); drop the field", key)


class CompletionRequest(_Sampling):
    """``/v1/completions``: ``prompt`` is a string or a list of token ids (one prompt per request)."""

    prompt: str | list[int]


class ChatRequest(_Sampling):
    """``/v1/chat/completions``: ``messages`` with text content, optional ``tools``."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None


def message_text(message: dict[str, Any], index: int) -> dict[str, Any]:
    """``message`` with its content as one string (text parts joined).

    Raises:
        RequestError: No ``role``, or content that is neither a string nor text parts.
    """
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise RequestError(400, f"messages[{index}] has no 'role'", f"messages[{index}].role")
    content = message.get("content")
    if content is None:
        content = ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            text = part.get("text") if isinstance(part, dict) else None
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(text, str)):
                raise RequestError(400, f"messages[{index}].content[{j}] is not a text part "
                                   "({'type': 'text', 'text': ...}); the token server takes text only",
                                   f"messages[{index}].content")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise RequestError(400, f"messages[{index}].content must be a string or text parts, got "
                           f"{type(content).__name__}", f"messages[{index}].content")
    return {**message, "content": content}
