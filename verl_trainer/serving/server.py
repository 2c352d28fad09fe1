"""An OpenAI-compatible HTTP server over a rollout backend that returns token ids and log-probs.

Endpoints: ``GET /v1/models``, ``POST /v1/completions`` (prompt as text or token ids), ``POST
/v1/chat/completions`` (messages rendered by the policy's chat template). Each choice carries, beside
OpenAI's fields, ``token_ids`` (the sampled ids, eos included when sampled) and per-token log-probs
(``logprobs.content[i] = {"token", "token_id", "logprob", "bytes", "top_logprobs": []}`` for chat,
``logprobs.tokens`` / ``token_logprobs`` for completions); the response carries ``prompt_token_ids``
(vLLM's names).

Requests tagged with a trajectory id are recorded (:mod:`verl_trainer.serving.trajectories`). A
trajectory the trainer registered samples with the trainer's settings (temperature, top-p, top-k) and
seeds, within its token budget (model and observation tokens, ``max_new_tokens``), whatever the request
asks; a turn whose observation leaves no room is answered empty (``finish_reason: length``) and not recorded,
so the trajectory ends before it. Other requests use their own settings.

Errors are OpenAI-style JSON bodies: 400 bad request (the field named), 404 unknown model, 409 a
trajectory turn already in flight, 429 more than ``max_concurrency`` requests admitted, 500 the backend
failed, 504 past ``request_timeout_s``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from verl_trainer.agents.template import ObservationEncoder
from verl_trainer.rollout.base import derive_sample_seed, truncate_at_eos
from verl_trainer.serving.config import ServerConfig
from verl_trainer.serving.engine import EngineJob, EngineThread, GenerateFn
from verl_trainer.serving.protocol import ChatRequest, CompletionRequest, RequestError, message_text
from verl_trainer.serving.trajectories import TrajectoryRecord, TrajectoryStore

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from verl_trainer.rollout.config import RolloutConfig

__all__ = ["TRAJECTORY_HEADER", "TokenServer"]

TRAJECTORY_HEADER = "X-Trajectory-Id"


@dataclasses.dataclass
class _Turn:
    prompt: list[int]
    observation: list[int]
    record: TrajectoryRecord | None
    messages: list[dict[str, Any]] | None


class TokenServer:
    """Serves ``generate`` (a backend's ``generate_token_ids``) over HTTP on a background thread.

    Args:
        generate: Prompt id lists, a ``RolloutConfig`` and seeds -> ``(ids, log_probs)``.
        rollout_config: The default sampling settings (a request overrides them unless its trajectory is
            registered).
        tokenizer: The policy's tokenizer (chat template, decoding).
        eos_token_ids: Ids that end a response.
        config: Address, limits, time-outs.

    Use :meth:`start` (returns the base URL, ``http://host:port/v1``) and :meth:`stop`, or ``with``.
    """

    def __init__(self, generate: GenerateFn, rollout_config: RolloutConfig,
                 tokenizer: PreTrainedTokenizerBase, eos_token_ids: list[int],
                 config: ServerConfig | None = None) -> None:
        self.config = config or ServerConfig()
        self.rollout_config = rollout_config
        self.tokenizer = tokenizer
        self.eos = sorted(int(e) for e in eos_token_ids)
        self.encoder = ObservationEncoder(tokenizer, self.eos) if getattr(tokenizer, "chat_template", None) \
            else None
        self.store = TrajectoryStore()
        self.engine = EngineThread(generate, self.config.max_batch)
        self._admitted = 0
        self._requests = 0
        self._thread: threading.Thread | None = None
        self._server: Any = None
        self.url: str | None = None
        self.app = self._build_app()

    # ------------------------------------------------------------------------------------ lifetime
    def start(self, timeout_s: float = 30.0) -> str:
        """Bind and serve; return the base URL (``http://host:port/v1``).

        Raises:
            RuntimeError: The server did not start within ``timeout_s`` (e.g. the port is taken).
        """
        import uvicorn

        if self.url is not None:
            return self.url
        config = uvicorn.Config(self.app, host=self.config.host, port=self.config.port, log_level="warning",
                                access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="token-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the token server did not start on {self.config.host}:{self.config.port} "
                                   "(is the port taken? set algorithm.rollout.multi_turn.server.port=0 for a "
                                   "free one)")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{self.config.host}:{port}/v1"
        return self.url

    def stop(self) -> None:
        """Stop serving and end the engine thread (idempotent)."""
        if self._server is not None:
            self._server.should_exit = True
            if self._thread is not None:
                self._thread.join(timeout=30)
            self._server = None
            self.url = None
        self.engine.stop()

    def __enter__(self) -> TokenServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------ app
    def _build_app(self) -> Any:
        from verl_trainer.serving.app import build_app  # lazy: FastAPI, of the optional `serve` extra

        return build_app(self)

    async def admit(self, handler: Any, body: Any, header_id: str | None) -> dict[str, Any]:
        """Run ``handler(body, trajectory id)`` if fewer than ``max_concurrency`` requests are in flight.

        Raises:
            RequestError: 429 when the server is full.
        """
        if self._admitted >= self.config.max_concurrency:
            raise RequestError(429, f"the token server has {self._admitted} requests in flight "
                               f"(max_concurrency={self.config.max_concurrency}); retry later",
                               kind="rate_limit_error")
        self._admitted += 1
        try:
            return await handler(body, body.trajectory_id or header_id)
        finally:
            self._admitted -= 1

    # ------------------------------------------------------------------------------------ requests
    def _check(self, body: Any, trajectory_id: str | None) -> None:
        body.check_supported()
        if body.model not in (None, "", self.config.model_name):
            raise RequestError(404, f"model {body.model!r} does not exist; this server serves "
                               f"{self.config.model_name!r}", "model", "not_found_error")
        if body.n > self.config.max_n:
            raise RequestError(400, f"n={body.n} is above the server's max_n={self.config.max_n}", "n")
        if trajectory_id is not None and body.n != 1:
            raise RequestError(400, f"n={body.n} with trajectory {trajectory_id!r}: a trajectory continues "
                               "one choice; send n=1", "n")

    async def completion(self, body: CompletionRequest, trajectory_id: str | None) -> dict[str, Any]:
        """Answer ``/v1/completions`` (see the module docstring)."""
        self._check(body, trajectory_id)
        if isinstance(body.prompt, str):
            prompt = list(self.tokenizer.encode(body.prompt, add_special_tokens=False))
        else:
            prompt = list(body.prompt)
            vocab = len(self.tokenizer)
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise RequestError(400, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                                   "prompt")
        if not prompt:
            raise RequestError(400, "the prompt is empty", "prompt")

        def plan(record: TrajectoryRecord | None) -> _Turn:
            tid = trajectory_id or ""
            observation = [] if record is None else self.store.plan_tokens(record, prompt, tid)
            return _Turn(prompt, observation, record, None)

        choices, usage, prompt_ids = await self._turn(body, trajectory_id, plan)
        out = [{"index": i, "text": text, "token_ids": ids, "finish_reason": finish,
                "logprobs": {"tokens": [self.tokenizer.decode([t]) for t in ids], "token_logprobs": lps}}
               for i, (ids, lps, text, finish) in enumerate(choices)]
        return self._response("cmpl", "text_completion", out, prompt_ids, usage)

    async def chat(self, body: ChatRequest, trajectory_id: str | None) -> dict[str, Any]:
        """Answer ``/v1/chat/completions`` (see the module docstring)."""
        self._check(body, trajectory_id)
        if self.encoder is None:
            raise RequestError(400, "the policy's tokenizer has no chat template; use /v1/completions",
                               "messages")
        messages = [message_text(m, i) for i, m in enumerate(body.messages)]
        if body.max_completion_tokens is not None and body.max_tokens is None:
            body.max_tokens = body.max_completion_tokens

        def plan(record: TrajectoryRecord | None) -> _Turn:
            added = None if record is None else self.store.plan_chat(record, messages, trajectory_id or "")
            if added is None:
                if record is not None and record.prompt_ids is not None:
                    raise RequestError(400, f"trajectory {trajectory_id!r} began with token ids; continue it "
                                       "with /v1/completions", "messages")
                text = self.tokenizer.apply_chat_template(messages, tools=body.tools, tokenize=False,
                                                          add_generation_prompt=True)
                prompt = list(self.tokenizer.encode(text, add_special_tokens=False))
                return _Turn(prompt, [], record, messages)
            observation = self.encoder.encode(added)
            return _Turn(record.context() + observation, observation, record, messages)

        choices, usage, prompt_ids = await self._turn(body, trajectory_id, plan)
        out = [{"index": i, "message": {"role": "assistant", "content": text}, "token_ids": ids,
                "finish_reason": finish,
                "logprobs": {"content": [_chat_logprob(self.tokenizer.decode([t]), t, lp)
                                         for t, lp in zip(ids, lps)]}}
               for i, (ids, lps, text, finish) in enumerate(choices)]
        return self._response("chatcmpl", "chat.completion", out, prompt_ids, usage)

    def _response(self, prefix: str, kind: str, choices: list, prompt_ids: list[int], usage: dict) -> dict:
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
                "model": self.config.model_name, "choices": choices, "prompt_token_ids": prompt_ids,
                "usage": usage}

    async def _turn(self, body: Any, trajectory_id: str | None, plan: Any) -> tuple[list[tuple], dict, list]:
        """Plan, generate and (for a trajectory) record one turn; ``(choices, usage, prompt ids)``."""
        record = self.store.begin(trajectory_id) if trajectory_id is not None else None
        try:
            turn = plan(record)
            config, seeds, budget = self._sampling(body, turn, trajectory_id)
            if budget <= 0:  # the observation fills the budget: an empty, length-cut answer
                choices = [([], [], "", "length")]
            else:
                job = EngineJob([turn.prompt] * body.n, config, seeds)
                future = self.engine.submit(job)
                try:
                    limit = self.config.request_timeout_s
                    ids, lps = await asyncio.wait_for(asyncio.wrap_future(future), limit)
                except asyncio.TimeoutError:
                    future.cancel()
                    raise RequestError(504, f"the request ran past request_timeout_s="
                                       f"{self.config.request_timeout_s:g}", kind="timeout_error") from None
                except RequestError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the backend's failure, reported to the client
                    raise RequestError(500, f"the rollout backend failed: {type(exc).__name__}: {exc}"[:1000],
                                       kind="server_error") from exc
                choices = []
                for generated, log_probs in zip(ids, lps):
                    kept = truncate_at_eos(generated, self.eos)[:budget]
                    finish = "stop" if kept and kept[-1] in self.eos else "length"
                    text = self.tokenizer.decode(kept, skip_special_tokens=True)
                    choices.append((kept, [float(x) for x in log_probs[: len(kept)]], text, finish))
            if record is not None and budget > 0:  # a turn past the budget is answered, not recorded
                kept, lps, text, _ = choices[0]
                self.store.record(record, turn.prompt, turn.observation, kept, lps, turn.messages, text)
        finally:
            if trajectory_id is not None:
                self.store.end(trajectory_id)
        generated = sum(len(c[0]) for c in choices)
        usage = {"prompt_tokens": len(turn.prompt), "completion_tokens": generated,
                 "total_tokens": len(turn.prompt) + generated}
        return choices, usage, turn.prompt

    def _sampling(self, body: Any, turn: _Turn, trajectory_id: str | None) -> tuple[Any, list[int], int]:
        """``(RolloutConfig, seeds, token budget)`` of a turn."""
        base = self.rollout_config
        registration = self.store.registration(trajectory_id) if trajectory_id is not None else None
        if registration is not None:
            record = turn.record
            first = record is None or record.prompt_ids is None
            if first and turn.prompt != list(registration.prompt_ids):
                raise RequestError(400, f"trajectory {trajectory_id!r}: the first prompt ({len(turn.prompt)} "
                                   f"ids) is not the dataset prompt ({len(registration.prompt_ids)} ids) the "
                                   "trainer registered; send the row's prompt (AgentContext.messages or "
                                   ".prompt_ids) unchanged", "messages")
            used = 0 if first else len(record.ids) + len(turn.observation)
            budget = registration.max_new_tokens - used
            if body.max_tokens is not None:
                budget = min(budget, body.max_tokens)
            turns = 0 if record is None else record.turns
            seed = registration.seed if turns == 0 else registration.turn_seed(registration.seed, turns)
            config = dataclasses.replace(base, n=1, max_new_tokens=max(budget, 1))
            return config, [seed], budget
        budget = body.max_tokens or base.max_new_tokens
        overrides: dict[str, Any] = {"n": 1, "max_new_tokens": budget}
        if body.temperature is not None:
            overrides.update(do_sample=body.temperature > 0)
            if body.temperature > 0:
                overrides["temperature"] = body.temperature
        if body.top_p is not None:
            overrides["top_p"] = body.top_p
        if body.top_k is not None:
            overrides["top_k"] = body.top_k
        try:
            config = dataclasses.replace(base, **overrides)
        except ValueError as exc:
            raise RequestError(400, f"sampling settings rejected: {exc}") from exc
        self._requests += 1
        if body.seed is not None:
            seeds = [derive_sample_seed(body.seed, 0, 0, j) for j in range(body.n)]
        else:
            seeds = [derive_sample_seed(self.config.seed, self._requests, 0, j, 2) for j in range(body.n)]
        return config, seeds, budget


def _chat_logprob(token: str, token_id: int, logprob: float) -> dict:
    """One ``logprobs.content`` entry: ``token_id`` beside OpenAI's required fields.

    ``bytes`` and ``top_logprobs`` (empty: none asked) are required by OpenAI's schema, which strict clients
    (verifiers) validate.
    """
    return {"token": token, "token_id": token_id, "logprob": logprob, "bytes": list(token.encode()),
            "top_logprobs": []}
