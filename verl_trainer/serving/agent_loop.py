"""Rollouts by an external agent that talks to the policy through the token server.

An **agent** is a function ``agent(context: AgentContext) -> float | None`` (plain or ``async``): it runs one
trajectory against the OpenAI-compatible endpoint ``context.base_url`` (any OpenAI client, a verifiers
environment, an HTTP library), tagging each request with ``context.trajectory_id`` (body field
``trajectory_id`` or header ``X-Trajectory-Id``: ``context.headers``), and returns the trajectory's reward
(``None``: 0; the reward functions of ``algorithm.reward.name`` score the final answer too).

:class:`ServedAgentLoop` has :class:`~verl_trainer.rollout.agent_loop.AgentLoop`'s ``run`` signature, so a
backend's ``generate`` uses it unchanged: it starts the :class:`~verl_trainer.serving.server.TokenServer` on
the backend's ``generate_token_ids`` (once; it serves until :meth:`ServedAgentLoop.close` or the process
ends), registers one trajectory per response (its seed, its budget ``max_new_tokens``, the dataset prompt),
runs the agents on threads (``max_parallel`` at once, each under ``agent_timeout_s``) and assembles each
trajectory from the ids the server sampled: model ids with mask 1, observation ids with mask 0. An agent
that raises or runs late keeps the turns recorded before it (counted ``agent/env_errors`` /
``agent/env_timeouts``, reward 0).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from verl_trainer.serving.agent_spec import resolve_agent
from verl_trainer.serving.config import ServerConfig
from verl_trainer.serving.server import TRAJECTORY_HEADER, TokenServer
from verl_trainer.serving.trajectories import Registration
from verl_trainer.utils.daemon_calls import AbandonedCallError, DaemonCalls

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from verl_trainer.rollout.agent_loop import Trajectory

__all__ = ["AgentContext", "ServedAgentLoop", "served_agent_loop"]


@dataclass(frozen=True)
class AgentContext:
    """What an agent gets for one trajectory.

    Attributes:
        base_url: The server's OpenAI base URL (``http://127.0.0.1:PORT/v1``).
        model: The model name to request.
        trajectory_id: The tag of every request of this trajectory.
        prompt_ids: The dataset prompt's ids (send them to ``/v1/completions`` as the first prompt, or send
            the messages they were rendered from to ``/v1/chat/completions``).
        prompt_text: Their text.
        row: The prompt row's ``ground_truth``, ``data_source``, ``extra_info``.
    """

    base_url: str
    model: str
    trajectory_id: str
    prompt_ids: list[int]
    prompt_text: str
    row: Mapping[str, Any] = field(default_factory=dict)

    @property
    def headers(self) -> dict[str, str]:
        """The trajectory header for clients that cannot add body fields."""
        return {TRAJECTORY_HEADER: self.trajectory_id}


AgentFn = Callable[[AgentContext], Any]


def _call(agent: AgentFn, context: AgentContext) -> Any:
    result = agent(context)
    if inspect.isawaitable(result):
        result = asyncio.run(_awaited(result))
    return result


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


class ServedAgentLoop:
    """Multi-turn rollouts by an external agent over the token server (see the module docstring).

    Args:
        agent: The agent function.
        tokenizer: The policy's tokenizer.
        eos_token_ids: Ids that end a model turn.
        server: The server's settings.
        max_parallel: Agents running at once.
        agent_timeout_s: The longest one agent may run.
    """

    def __init__(self, agent: AgentFn, tokenizer: PreTrainedTokenizerBase, eos_token_ids: Sequence[int],
                 server: ServerConfig | None = None, max_parallel: int = 16,
                 agent_timeout_s: float = 300.0) -> None:
        if not callable(agent):
            raise ValueError(f"agent {agent!r} is not callable; give a function agent(context) -> reward")
        self.agent = agent
        self.tokenizer = tokenizer
        self.eos = sorted(int(e) for e in eos_token_ids)
        self.server_config = server or ServerConfig()
        self.max_parallel = max_parallel
        self.agent_timeout_s = agent_timeout_s
        self.server: TokenServer | None = None
        self._threads = DaemonCalls("served-agent")
        self._finalizer: weakref.finalize | None = None
        self.last_errors: list[str] = []
        """The errors of the last :meth:`run`'s failed agents (for messages and tests)."""

    def close(self) -> None:
        """Stop the server (a later :meth:`run` starts a new one); also run when the loop is collected."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self.server = None

    def _ensure_server(self, generate: Any, config: Any) -> TokenServer:
        if self.server is None or self.server.engine.generate != generate:  # bound methods compare equal
            self.close()
            self.server = TokenServer(generate, config, self.tokenizer, self.eos, self.server_config)
            self.server.start()
            self._finalizer = weakref.finalize(self, self.server.stop)  # the rollout's lifetime
        self.server.rollout_config = config
        return self.server

    def run(self, generate: Any, prompts: list[list[int]], rows: list[dict[str, Any]], config: Any,
            seeds: list[int], turn_seed: Callable[[int, int], int],
            context_limit: int | None = None) -> list[Trajectory]:
        """Run one agent per prompt (prompts already repeated ``n`` times) and assemble the trajectories.

        Turn 0 of a trajectory samples from its entry of ``seeds``, turn ``t`` from ``turn_seed(seed, t)``.
        """
        from verl_trainer.rollout.agent_loop import Trajectory  # lazy: rollout/__init__ builds this loop

        server = self._ensure_server(generate, config)
        self.last_errors = []
        budget = config.max_new_tokens
        if context_limit is not None:
            budget = min(budget, max(context_limit - max(len(p) for p in prompts), 1))
        contexts = []
        for prompt, row, seed in zip(prompts, rows, seeds):
            tid = f"traj-{uuid.uuid4().hex}"
            server.store.register(tid, Registration(tuple(prompt), int(seed), int(budget), turn_seed))
            contexts.append(AgentContext(server.url or "", self.server_config.model_name, tid, list(prompt),
                                         self.tokenizer.decode(prompt), dict(row)))
        outcomes = []
        for start in range(0, len(contexts), self.max_parallel):
            chunk = contexts[start: start + self.max_parallel]
            calls = [functools.partial(_call, self.agent, c) for c in chunk]  # no reference to self
            outcomes.extend(self._threads.outcomes(calls, self.agent_timeout_s))
        trajectories = []
        for context, (value, error) in zip(contexts, outcomes):
            record = server.store.take(context.trajectory_id)
            trajectory = Trajectory()
            for ids, mask, lps in _runs(record.ids, record.model_mask, record.log_probs):
                trajectory.extend(ids, lps if mask else None)
            trajectory.turns = record.turns
            trajectory.messages = list(record.messages or [])[_prompt_messages(record):]
            if error is None:
                try:
                    trajectory.reward = _reward(value, context)
                except TypeError as exc:
                    error = exc
            if isinstance(error, AbandonedCallError):
                trajectory.env_timeouts += 1
            elif error is not None:
                trajectory.env_errors += 1
                self.last_errors.append(f"{type(error).__name__}: {error}"[:500])
            trajectory.done = True
            trajectories.append(trajectory)
        return trajectories


def _runs(ids: list[int], mask: list[int], log_probs: list[float]):
    """Maximal runs of equal mask: ``(ids, mask, log_probs)``."""
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            yield ids[start:i], mask[start], log_probs[start:i]
            start = i


def _prompt_messages(record: Any) -> int:
    """How many of the recorded messages were the first prompt's (the rest are the response's)."""
    messages = record.messages or []
    first_assistant = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    return first_assistant


def _reward(value: Any, context: AgentContext) -> float:
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"the agent returned {value!r} for trajectory {context.trajectory_id!r}; return a "
                        "number (the trajectory's reward) or None")
    return float(value)


def served_agent_loop(config: Any, tokenizer: PreTrainedTokenizerBase,
                      eos_token_ids: Sequence[int]) -> ServedAgentLoop:
    """The :class:`ServedAgentLoop` of a ``MultiTurnConfig`` with ``agent`` set."""
    return ServedAgentLoop(resolve_agent(config.agent), tokenizer, eos_token_ids, config.server,
                           agent_timeout_s=config.agent_timeout_s)
