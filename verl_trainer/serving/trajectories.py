"""Trajectory tagging: the token server records every turn of a tagged conversation as sampled ids.

A client tags its requests with a trajectory id (``trajectory_id`` field or ``X-Trajectory-Id`` header).
For each tagged turn the server keeps the prompt ids it generated from and the ids and log-probs it
sampled, so the trainer assembles the conversation from the ids themselves, never by re-tokenising text
(a decode-encode round trip may give other ids: the retokenisation bug).

A later turn must extend the trajectory: a token-id prompt must start with everything so far (its
remainder is observation tokens); a chat request's messages must start with the messages so far (the
assistant turns' text is not compared: the server keeps their ids) and its new messages are encoded as
the chat template writes them after an assistant turn
(:class:`~verl_trainer.agents.template.ObservationEncoder`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from verl_trainer.serving.protocol import RequestError

__all__ = ["Registration", "TrajectoryRecord", "TrajectoryStore"]


@dataclass(frozen=True)
class Registration:
    """A trajectory the trainer opened before its agent runs.

    Attributes:
        prompt_ids: The dataset prompt's ids: the first turn's prompt must equal them.
        seed: The trajectory's seed: turn 0 samples from it, turn ``t`` from ``turn_seed(seed, t)``.
        max_new_tokens: Token budget of the whole response (model and observation tokens).
        turn_seed: The rollout's turn-seed function (``AgentLoop``'s, so both loops sample alike).
    """

    prompt_ids: tuple[int, ...]
    seed: int
    max_new_tokens: int
    turn_seed: Callable[[int, int], int]


@dataclass
class TrajectoryRecord:
    """What the server recorded for one trajectory.

    Attributes:
        prompt_ids: The first turn's prompt.
        ids: Everything after it: sampled ids (mask 1) and observation ids (mask 0), in order.
        model_mask: 1 per sampled id.
        log_probs: Per id, the sampler's log-prob (0.0 on observation ids).
        messages: The conversation so far (chat turns), assistant turns included.
        turns: Turns generated.
        registration: The trainer's registration, if any.
    """

    prompt_ids: list[int] | None = None
    ids: list[int] = field(default_factory=list)
    model_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    messages: list[dict[str, Any]] | None = None
    turns: int = 0
    registration: Registration | None = None

    def context(self) -> list[int]:
        """Prompt and everything after it."""
        return list(self.prompt_ids or []) + self.ids


class TrajectoryStore:
    """Thread-safe turns by trajectory id.

    A turn is planned (:meth:`plan_tokens` / :meth:`plan_chat`: the prompt ids it generates from and the
    observation ids it adds) and then, once generated, recorded (:meth:`record`); a turn that failed or
    timed out is never recorded. Turns of one trajectory are serial: a second request while one is in
    flight is a 409.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, TrajectoryRecord] = {}
        self._busy: set[str] = set()

    def register(self, trajectory_id: str, registration: Registration) -> None:
        """Open ``trajectory_id`` for the trainer (replacing nothing: a known id raises ``ValueError``)."""
        with self._lock:
            if trajectory_id in self._records:
                raise ValueError(f"trajectory {trajectory_id!r} is already open")
            self._records[trajectory_id] = TrajectoryRecord(registration=registration)

    def take(self, trajectory_id: str) -> TrajectoryRecord:
        """Remove and return the record (an empty one when no turn was recorded)."""
        with self._lock:
            self._busy.discard(trajectory_id)
            return self._records.pop(trajectory_id, None) or TrajectoryRecord()

    def registration(self, trajectory_id: str) -> Registration | None:
        """The trainer's registration of ``trajectory_id`` (``None``: not registered)."""
        with self._lock:
            record = self._records.get(trajectory_id)
            return None if record is None else record.registration

    def begin(self, trajectory_id: str) -> TrajectoryRecord:
        """Mark a turn in flight and return the record (created on first use).

        Raises:
            RequestError: 409 when a turn of this trajectory is already in flight.
        """
        with self._lock:
            if trajectory_id in self._busy:
                raise RequestError(409, f"trajectory {trajectory_id!r} has a turn in flight; send its turns "
                                   "one after another", "trajectory_id")
            self._busy.add(trajectory_id)
            return self._records.setdefault(trajectory_id, TrajectoryRecord())

    def end(self, trajectory_id: str) -> None:
        """The turn :meth:`begin` marked is over (recorded or not)."""
        with self._lock:
            self._busy.discard(trajectory_id)

    @staticmethod
    def plan_tokens(record: TrajectoryRecord, prompt: list[int], trajectory_id: str) -> list[int]:
        """The observation ids a token-id prompt adds to ``record``.

        Raises:
            RequestError: 400 when ``prompt`` does not start with the trajectory's ids so far.
        """
        if record.prompt_ids is None:
            return []
        context = record.context()
        if prompt[: len(context)] != context:
            at = next((i for i, (a, b) in enumerate(zip(prompt, context)) if a != b), min(len(prompt),
                                                                                          len(context)))
            raise RequestError(400, f"trajectory {trajectory_id!r}: the prompt does not extend the "
                               f"trajectory's {len(context)} ids so far (first difference at id {at}); send "
                               "the previous prompt + the returned token_ids + the new tokens", "prompt")
        return prompt[len(context):]

    @staticmethod
    def plan_chat(record: TrajectoryRecord, messages: list[dict[str, Any]], trajectory_id: str
                  ) -> list[dict[str, Any]] | None:
        """The new messages of a chat turn on ``record`` (``None``: the trajectory has no chat turn yet).

        Raises:
            RequestError: 400 when ``messages`` do not start with the conversation so far, or add an
                assistant message (its tokens were not sampled here) or nothing.
        """
        if record.messages is None:
            return None
        seen = record.messages
        if len(messages) <= len(seen):
            raise RequestError(400, f"trajectory {trajectory_id!r}: {len(messages)} messages, the "
                               f"conversation already has {len(seen)}; send the whole conversation plus the "
                               "new message(s)", "messages")
        for i, (old, new) in enumerate(zip(seen, messages)):
            same_text = old["role"] == "assistant" or old["content"] == new["content"]
            if old["role"] != new["role"] or not same_text:
                raise RequestError(400, f"trajectory {trajectory_id!r}: messages[{i}] ({new['role']}) "
                                   f"differs from the conversation so far ({old['role']}); a trajectory only "
                                   "grows",
                                   f"messages[{i}]")
        added = messages[len(seen):]
        for j, message in enumerate(added):
            if message["role"] == "assistant":
                raise RequestError(400, f"trajectory {trajectory_id!r}: messages[{len(seen) + j}] is an "
                                   "assistant message the server did not sample; its tokens cannot be "
                                   "trained",
                                   f"messages[{len(seen) + j}]")
        return added

    @staticmethod
    def record(record: TrajectoryRecord, prompt: list[int], observation: list[int], sampled: list[int],
               log_probs: list[float], messages: list[dict[str, Any]] | None, reply: str | None) -> None:
        """Append a generated turn (call between :meth:`begin` and :meth:`end`)."""
        if record.prompt_ids is None:
            record.prompt_ids = list(prompt)
        else:
            record.ids.extend(observation)
            record.model_mask.extend([0] * len(observation))
            record.log_probs.extend([0.0] * len(observation))
        record.ids.extend(sampled)
        record.model_mask.extend([1] * len(sampled))
        record.log_probs.extend(float(x) for x in log_probs)
        if messages is not None:
            record.messages = [*messages, {"role": "assistant", "content": reply or ""}]
        record.turns += 1
