"""Token-in, token-out multi-turn rollout: generate, run the tools / environment, append, repeat.

:class:`AgentLoop` drives any backend's :meth:`~verl_trainer.rollout.base.BaseRollout.generate_token_ids`
(the HF and the vLLM rollouts share it). Each turn every unfinished trajectory is extended by one model
turn (cut at its eos, within the trajectory's remaining token budget); the turn's text is decoded **only to
read tool calls** — the trajectory keeps the sampled ids. Tool calls of the whole batch run concurrently
(threads) under ``tool_timeout_s``; their results (or error observations) become ``role: tool`` messages,
an environment's answer a ``role: user`` message, rendered through the chat template
(:class:`~verl_trainer.agents.template.ObservationEncoder`) and appended as tokens with mask 0.

A trajectory ends when a turn makes no tool call and the environment (if any) says done, at
``max_turns`` assistant turns, or when its tokens reach ``max_new_tokens`` (model and observation tokens
together: the response budget) or, with a backend of bounded context (vLLM's ``max_model_len``), when
prompt and trajectory fill that context; an observation is appended whole or, when it would leave no room
for the model's answer, not at all (the trajectory ends there). Turn 0 samples from the response's own seed,
so a trajectory whose first turn calls no tool is exactly the single-turn rollout's response; turn ``t``
samples from a seed derived from it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from verl_trainer.agents.config import MultiTurnConfig, resolve_environment, resolve_tools
from verl_trainer.agents.environment import Environment, StepResult
from verl_trainer.agents.parsers import MalformedToolCall, ToolCall, get_tool_call_parser
from verl_trainer.agents.template import ObservationEncoder
from verl_trainer.agents.tools import Tool, ToolError
from verl_trainer.data import schema
from verl_trainer.metrics import Metric
from verl_trainer.rollout.base import AGENT_INFO

__all__ = ["AgentLoop", "Trajectory", "agent_rewards_and_metrics"]

GenerateFn = Callable[[list[list[int]], Any, list[int]], tuple[list[list[int]], list[list[float]]]]


@dataclass
class Trajectory:
    """One multi-turn response: its tokens, which of them the model sampled, and what happened.

    Attributes:
        ids: Response token ids (model turns and observations, in order).
        model_mask: 1 per model-sampled id, 0 per observation id (the loss mask).
        log_probs: The sampler's log-prob per id (0.0 on observation ids).
        turns: Assistant turns taken.
        tool_calls: Tool calls made (malformed ones included).
        tool_errors: Calls answered with an error (malformed, unknown tool, the tool raised).
        tool_timeouts: Calls that ran past ``tool_timeout_s``.
        per_tool: Calls per tool name.
        reward: The environment's and the tools' summed reward.
        messages: The conversation after the prompt (assistant text decoded for reading only).
    """

    ids: list[int] = field(default_factory=list)
    model_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    per_tool: Counter = field(default_factory=Counter)
    reward: float = 0.0
    messages: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False

    def extend(self, ids: Sequence[int], log_probs: Sequence[float] | None) -> None:
        """Append model ids (with their log-probs) or, with ``log_probs=None``, observation ids."""
        self.ids.extend(ids)
        self.model_mask.extend([0 if log_probs is None else 1] * len(ids))
        self.log_probs.extend([0.0] * len(ids) if log_probs is None else log_probs)

    def info(self) -> dict[str, Any]:
        """Counts for metrics (``agent/*``) and the trajectory reward, as plain data."""
        return {"turns": self.turns, "tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
                "tool_timeouts": self.tool_timeouts, "per_tool": dict(self.per_tool), "reward": self.reward,
                "observation_tokens": len(self.ids) - sum(self.model_mask), "messages": self.messages}


class AgentLoop:
    """Runs multi-turn trajectories over a rollout backend.

    Args:
        config: The multi-turn settings (tools and environment resolved here).
        tokenizer: The policy's tokenizer (chat template, decoding of model turns for the parser).
        eos_token_ids: Ids that end a model turn.
    """

    def __init__(self, config: MultiTurnConfig, tokenizer: Any, eos_token_ids: Sequence[int]) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.eos = set(int(e) for e in eos_token_ids)
        self.tools: dict[str, Tool] = {t.name: t for t in resolve_tools(config.tools)}
        self.environment = resolve_environment(config.environment)
        self.parse = get_tool_call_parser(config.tool_call_format)
        self.encoder = ObservationEncoder(tokenizer, sorted(self.eos))

    # ----------------------------------------------------------------------------------------- tools
    def _call(self, instance_id: str, call: ToolCall | MalformedToolCall) -> tuple[str, str]:
        """``(status, text)`` of one call: status ``ok`` or ``error`` (never raises)."""
        if isinstance(call, MalformedToolCall):
            return "error", f"Error: {call.error}"
        tool = self.tools.get(call.name)
        if tool is None:
            return "error", f"Error: no tool named {call.name!r}; the tools are {sorted(self.tools)}"
        try:
            return "ok", tool.execute(instance_id, call.arguments)
        except ToolError as exc:
            return "error", f"Error: {exc}"
        except Exception as exc:  # noqa: BLE001 - a failing tool is an observation, never a crashed run
            return "error", f"Error: {call.name} failed: {type(exc).__name__}: {exc}"

    def _run_calls(self, jobs: list[tuple[str, ToolCall | MalformedToolCall]]) -> list[tuple[str, str]]:
        """Run every call of a turn concurrently; a call past ``tool_timeout_s`` gets status ``timeout``.

        A timed-out call's thread is not killed (Python cannot); its result is dropped. Tools that run
        programs (the ``python`` tool) kill them on their own limits.
        """
        if not jobs:
            return []
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="agent-tool")
        try:
            futures = [pool.submit(self._call, iid, call) for iid, call in jobs]
            concurrent.futures.wait(futures, timeout=self.config.tool_timeout_s)
            timeout = f"Error: the tool call ran past {self.config.tool_timeout_s:g} s and was abandoned"
            return [f.result() if f.done() else ("timeout", timeout) for f in futures]
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _clip(self, text: str) -> str:
        limit = self.config.max_tool_response_length
        return text if len(text) <= limit else text[:limit] + "..."

    # ------------------------------------------------------------------------------------------ loop
    def run(self, generate: GenerateFn, prompts: list[list[int]], rows: list[Mapping[str, Any]], config: Any,
            seeds: list[int], derive_seed: Callable[[int, int], int],
            context_limit: int | None = None) -> list[Trajectory]:
        """Roll out one trajectory per prompt.

        Args:
            generate: The backend's ``generate_token_ids(prompts, config, seeds)``.
            prompts: ``N`` prompt id lists (already repeated ``n`` times).
            rows: ``N`` prompt rows (``ground_truth``, ``data_source``, ``extra_info``) for tools and
                environments.
            config: The call's :class:`~verl_trainer.rollout.config.RolloutConfig` (``max_new_tokens``: the
                response budget of a whole trajectory).
            seeds: ``N`` seeds, one per trajectory (turn 0 samples from it).
            derive_seed: ``(seed, turn) -> seed`` of a later turn.
            context_limit: The most tokens (prompt + trajectory) the backend can hold (vLLM's
                ``max_model_len``); ``None``: unbounded (HF). A trajectory's budget is then
                ``min(max_new_tokens, context_limit - prompt length)``, so no turn asks for a context the
                backend cannot take.

        Returns:
            ``N`` :class:`Trajectory` objects.
        """
        budgets = [config.max_new_tokens if context_limit is None else
                   max(1, min(config.max_new_tokens, context_limit - len(p))) for p in prompts]
        trajs = [Trajectory() for _ in prompts]
        ids = [uuid.uuid4().hex for _ in prompts]
        envs: list[Environment | None] = [self.environment() if self.environment else None for _ in prompts]
        try:
            for i, row in enumerate(rows):
                for tool in self.tools.values():
                    tool.create(ids[i], row)
                if envs[i] is not None:
                    envs[i].reset(row)
            for turn in range(self.config.max_turns):
                active = [i for i, t in enumerate(trajs) if not t.done]
                if not active:
                    break
                self._model_turn(generate, prompts, trajs, active, config, budgets,
                                 [seeds[i] if turn == 0 else derive_seed(seeds[i], turn) for i in active])
                self._observe(trajs, active, ids, envs, budgets, last=turn == self.config.max_turns - 1)
            for i, t in enumerate(trajs):
                t.reward += sum(float(tool.reward(ids[i])) for tool in self.tools.values())
        finally:
            for i in range(len(prompts)):
                for tool in self.tools.values():
                    tool.release(ids[i])
                if envs[i] is not None:
                    envs[i].close()
        return trajs

    def _model_turn(self, generate: GenerateFn, prompts: list[list[int]], trajs: list[Trajectory],
                    active: list[int], config: Any, budgets: list[int], seeds: list[int]) -> None:
        left = [budgets[i] - len(trajs[i].ids) for i in active]
        turn_config = dataclasses.replace(config, max_new_tokens=max(left))
        out, lps = generate([prompts[i] + trajs[i].ids for i in active], turn_config, seeds)
        for i, room, sampled, lp in zip(active, left, out, lps):
            cut = next((k + 1 for k, t in enumerate(sampled) if t in self.eos), len(sampled))
            cut = min(cut, room)
            traj = trajs[i]
            traj.extend(sampled[:cut], [float(v) for v in lp[:cut]])
            traj.turns += 1
            text = self.tokenizer.decode(sampled[:cut], skip_special_tokens=True)
            traj.messages.append({"role": "assistant", "content": text})
            if len(traj.ids) >= budgets[i]:
                traj.done = True

    def _observe(self, trajs: list[Trajectory], active: list[int], ids: list[str],
                 envs: list[Environment | None], budgets: list[int], last: bool) -> None:
        """Tool calls and environment steps of this turn's messages; observations appended as tokens."""
        jobs: list[tuple[int, ToolCall | MalformedToolCall]] = []
        steps: list[int] = []
        for i in active:
            traj = trajs[i]
            calls = self.parse(traj.messages[-1]["content"]) if self.tools else []
            if calls and not traj.done:
                jobs.extend((i, c) for c in calls)
            elif envs[i] is not None and not traj.done:
                steps.append(i)
            else:
                traj.done = True
        results = self._run_calls([(ids[i], c) for i, c in jobs])
        replies: dict[int, list[dict[str, Any]]] = {}
        for (i, call), (status, text) in zip(jobs, results):
            traj = trajs[i]
            traj.tool_calls += 1
            name = call.name if isinstance(call, ToolCall) else "<malformed>"
            traj.per_tool[name] += 1
            traj.tool_errors += status == "error"
            traj.tool_timeouts += status == "timeout"
            replies.setdefault(i, []).append({"role": "tool", "name": name, "content": self._clip(text)})
        for i, result in zip(steps, self._run_steps([envs[i] for i in steps],
                                                    [trajs[i].messages[-1]["content"] for i in steps])):
            trajs[i].reward += float(result.reward)
            if result.done:
                trajs[i].done = True
            else:
                replies[i] = [{"role": "user", "content": self._clip(result.observation)}]
        for i, messages in replies.items():
            traj = trajs[i]
            if last:  # no turn follows: the observation would train nothing and answer nothing
                traj.done = True
                continue
            tokens = self.encoder.encode(messages)
            if len(traj.ids) + len(tokens) >= budgets[i]:  # no room left to answer it: it ends here
                traj.done = True
                continue
            traj.messages.extend(messages)
            traj.extend(tokens, None)

    def _run_steps(self, envs: list[Environment | None], messages: list[str]) -> list[StepResult]:
        """Environment steps of a turn, concurrently; one that raises ends its episode with reward 0."""
        def step(env: Environment | None, message: str) -> StepResult:
            try:
                return env.step(message)  # type: ignore[union-attr]
            except Exception as exc:  # noqa: BLE001 - reported as the episode's end, never a crashed run
                return StepResult(f"Error: the environment failed: {type(exc).__name__}: {exc}", 0.0, True)

        if not envs:
            return []
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(envs)) as pool:
            return list(pool.map(step, envs, messages))


def agent_rewards_and_metrics(batch: TensorDict,
                              prefix: str = "agent") -> tuple[torch.Tensor, dict[str, Metric]]:
    """The trajectories' environment + tool rewards ``[B]`` and the ``agent/*`` metrics of a rollout batch.

    Metrics (real samples only, means over trajectories, reduced as ``MEAN`` weighted by the rank's real
    trajectories, so the logged value is the whole batch's over every dp rank): ``{prefix}/turns``,
    ``{prefix}/tool_calls``, ``{prefix}/tool_errors``, ``{prefix}/tool_timeouts``, ``{prefix}/env_reward``,
    ``{prefix}/tool_calls/<name>``; ``{prefix}/correct_tool_use``: the share of trajectories that called a
    tool and got every call answered (no error, no timeout); ``{prefix}/tool_token_share``: observation
    tokens over all response tokens (weighted by the response tokens).

    Args:
        batch: A rollout batch with :data:`~verl_trainer.rollout.base.AGENT_INFO`.
        prefix: The metrics' prefix (``"agent"`` in training, ``"val/agent"`` in validation).
    """
    infos = list(batch[AGENT_INFO])
    real = schema.real_mask(batch).tolist()
    rewards = torch.tensor([float(i["reward"]) for i in infos], dtype=torch.float32)
    kept = [i for i, r in zip(infos, real) if r]
    count = len(kept)
    metrics: dict[str, Metric] = {}

    def mean(values: list[float]) -> Metric:
        return Metric.mean(torch.tensor(sum(values) / count if count else 0.0), weight=count)

    for key in ("turns", "tool_calls", "tool_errors", "tool_timeouts"):
        metrics[f"{prefix}/{key}"] = mean([float(i[key]) for i in kept])
    metrics[f"{prefix}/correct_tool_use"] = mean([float(i["tool_calls"] > 0 and i["tool_errors"] == 0
                                                        and i["tool_timeouts"] == 0) for i in kept])
    metrics[f"{prefix}/env_reward"] = mean([float(i["reward"]) for i in kept])
    for name in sorted({n for i in kept for n in i["per_tool"]}):
        metrics[f"{prefix}/tool_calls/{name}"] = mean([float(i["per_tool"].get(name, 0)) for i in kept])
    lens = batch[schema.RESPONSE_LEN][schema.real_mask(batch)]
    total = float(lens.sum())
    observed = float(sum(i["observation_tokens"] for i in kept))
    metrics[f"{prefix}/tool_token_share"] = Metric.mean(torch.tensor(observed / total if total else 0.0),
                                                        weight=total)
    return rewards, metrics
