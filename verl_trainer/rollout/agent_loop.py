"""Token-in, token-out multi-turn rollout: generate, run the tools / environment, append, repeat.

:class:`AgentLoop` drives any backend's :meth:`~verl_trainer.rollout.base.BaseRollout.generate_token_ids`.
Each turn extends every unfinished trajectory by one model turn (cut at its eos, within its remaining token
budget); the turn's text is decoded only to read tool calls — the trajectory keeps the sampled ids. A
turn's tool calls run concurrently; their results (or error observations) become ``role: tool`` messages,
an environment's answer a ``role: user`` message, rendered through the chat template
(:class:`~verl_trainer.agents.template.ObservationEncoder`) and appended as tokens with mask 0.

User code is bounded: every tool call (``create``, ``execute``, ``reward``, ``release``) and environment
call (construction with ``reset``, ``step``, ``close``) runs on a daemon thread under ``tool_timeout_s`` /
``environment_timeout_s`` (:class:`~verl_trainer.utils.daemon_calls.DaemonCalls`). A late call is abandoned
and counted (``tool_timeouts`` / ``env_timeouts``), one that raises is counted (``tool_errors`` /
``env_errors``): a failed ``execute`` or parser is an error observation, a failed ``step`` ends the
trajectory with that step's reward 0, a failed ``create`` / ``reset`` ends it after its first model turn, a
failed ``reward`` counts 0 (docs/agents.md, "Hanging tools and environments").

A trajectory ends when a turn makes no tool call and the environment (if any) says done, at ``max_turns``
assistant turns, when its tokens (model and observation) reach ``max_new_tokens``, or, with a bounded
context (vLLM's ``max_model_len``), when prompt and trajectory fill it; an observation is appended whole or,
when it would leave no room for the model's answer, not at all (the trajectory ends there). Turn 0 samples
from the response's own seed, so a trajectory whose first turn calls no tool is exactly the single-turn
rollout's response; turn ``t`` samples from a seed derived from it.
"""

from __future__ import annotations

import dataclasses
import functools
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict

from verl_trainer.agents.config import MultiTurnConfig, resolve_environment, resolve_tools
from verl_trainer.agents.environment import Environment, StepResult
from verl_trainer.agents.parsers import MalformedToolCall, ToolCall, get_tool_call_parser
from verl_trainer.agents.template import ObservationEncoder
from verl_trainer.agents.tools import Tool, ToolError, settle
from verl_trainer.data import schema
from verl_trainer.metrics import Metric
from verl_trainer.rollout.base import AGENT_INFO
from verl_trainer.utils.daemon_calls import AbandonedCallError, DaemonCalls

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from verl_trainer.rollout.config import RolloutConfig

__all__ = ["AgentLoop", "Trajectory", "agent_rewards_and_metrics"]

MAX_CALLS_PER_TURN = 32
"""Tool calls of one turn that run; the rest are answered with one error observation."""

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
        env_errors: Environment calls that raised.
        env_timeouts: Environment calls that ran past ``environment_timeout_s``.
        per_tool: Calls per tool name.
        reward: The environment's and the tools' summed reward.
        messages: The conversation after the prompt (assistant text decoded for reading only; an assistant
            turn whose calls ran has ``tool_calls``, ``[{"type": "function", "function": {"name",
            "arguments"}}]``); TRL-style rewards get it as ``completions[i]``.
    """

    ids: list[int] = field(default_factory=list)
    model_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    env_errors: int = 0
    env_timeouts: int = 0
    per_tool: Counter = field(default_factory=Counter)
    reward: float = 0.0
    messages: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    broken: bool = False
    """A tool's ``create`` or the environment's ``reset`` failed: the trajectory ends after its first turn."""

    def extend(self, ids: Sequence[int], log_probs: Sequence[float] | None) -> None:
        """Append model ids (with their log-probs) or, with ``log_probs=None``, observation ids."""
        self.ids.extend(ids)
        self.model_mask.extend([0 if log_probs is None else 1] * len(ids))
        self.log_probs.extend([0.0] * len(ids) if log_probs is None else log_probs)

    def info(self) -> dict[str, Any]:
        """Counts for metrics (``agent/*``) and the trajectory reward, as plain data."""
        return {"turns": self.turns, "tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
                "tool_timeouts": self.tool_timeouts, "env_errors": self.env_errors,
                "env_timeouts": self.env_timeouts, "per_tool": dict(self.per_tool), "reward": self.reward,
                "observation_tokens": len(self.ids) - sum(self.model_mask), "messages": self.messages}


class AgentLoop:
    """Runs multi-turn trajectories over a rollout backend.

    Args:
        config: The multi-turn settings (tools and environment resolved here).
        tokenizer: The policy's tokenizer (chat template, decoding of model turns for the parser).
        eos_token_ids: Ids that end a model turn.
    """

    def __init__(self, config: MultiTurnConfig, tokenizer: PreTrainedTokenizerBase,
                 eos_token_ids: Sequence[int]) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.eos = set(int(e) for e in eos_token_ids)
        tools = resolve_tools(config.tools, config.tool_config_path)
        self.tools: dict[str, Tool] = {t.name: t for t in tools}
        self.environment = resolve_environment(config.environment)
        self.parse = get_tool_call_parser(config.tool_call_format)
        self.encoder = ObservationEncoder(tokenizer, sorted(self.eos))
        self._tool_threads = DaemonCalls("agent-tool")
        self._env_threads = DaemonCalls("agent-environment")

    def _bounded(self, calls: list[Callable[[], Any]], env: bool) -> list[tuple[str, Any]]:
        """``(status, value or exception)`` per call: ``ok``, ``error`` or ``timeout`` (never raises)."""
        threads, limit = ((self._env_threads, self.config.environment_timeout_s) if env else
                          (self._tool_threads, self.config.tool_timeout_s))
        return [("ok", value) if error is None else
                ("timeout" if isinstance(error, AbandonedCallError) else "error", error)
                for value, error in threads.outcomes(calls, limit)]

    @staticmethod
    def _count(traj: Trajectory, status: str, env: bool) -> None:
        if env:
            traj.env_errors += status == "error"
            traj.env_timeouts += status == "timeout"
        else:
            traj.tool_errors += status == "error"
            traj.tool_timeouts += status == "timeout"

    # ----------------------------------------------------------------------------------------- tools
    def _call(self, instance_id: str, call: ToolCall | MalformedToolCall) -> tuple[str, str]:
        """``(status, text)`` of one call: status ``ok`` or ``error`` (never raises)."""
        if isinstance(call, MalformedToolCall):
            return "error", f"Error: {call.error}"
        tool = self.tools.get(call.name)
        if tool is None:
            return "error", f"Error: no tool named {call.name!r}; the tools are {sorted(self.tools)}"
        try:
            return "ok", str(settle(tool.execute(instance_id, call.arguments)))
        except ToolError as exc:
            return "error", f"Error: {exc}"
        except Exception as exc:  # noqa: BLE001 - a failing tool is an observation, never a crashed run
            return "error", f"Error: {call.name} failed: {type(exc).__name__}: {exc}"

    def _run_calls(self, jobs: list[tuple[str, ToolCall | MalformedToolCall]]) -> list[tuple[str, str]]:
        """Run every call of a turn concurrently; a call past ``tool_timeout_s`` gets status ``timeout``.

        A timed-out call is abandoned on its daemon thread (Python cannot stop it); its result is dropped.
        Tools that run programs (the ``python`` tool) kill them on their own limits.
        """
        timeout = f"Error: the tool call ran past {self.config.tool_timeout_s:g} s and was abandoned"
        outcomes = self._bounded([functools.partial(self._call, iid, call) for iid, call in jobs], env=False)
        results = []
        for (status, value), (_, call) in zip(outcomes, jobs):
            if status == "ok":
                results.append(value)
            elif status == "timeout":
                results.append(("timeout", timeout if value.started else f"Error: {value}"))
            else:  # a BaseException that _call does not catch (SystemExit, KeyboardInterrupt of the tool)
                name = getattr(call, "name", "?")
                results.append(("error", f"Error: {name} failed: {type(value).__name__}"))
        return results

    def _clip(self, text: str) -> str:
        """``text`` cut to ``max_tool_response_length`` (``...`` marks a cut), lone surrogates replaced."""
        limit = self.config.max_tool_response_length
        text = str(text)
        text = text if len(text) <= limit else text[:limit] + "..."
        return text.encode("utf-8", "replace").decode("utf-8")  # tokenizers refuse lone surrogates

    # ------------------------------------------------------------------------------------------ loop
    def run(self, generate: GenerateFn, prompts: list[list[int]], rows: list[Mapping[str, Any]],
            config: RolloutConfig, seeds: list[int], derive_seed: Callable[[int, int], int],
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
        envs: list[Environment | None] = [None] * len(prompts)
        try:
            self._start(trajs, ids, rows, envs)
            for turn in range(self.config.max_turns):
                active = [i for i, t in enumerate(trajs) if not t.done]
                if not active:
                    break
                self._model_turn(generate, prompts, trajs, active, config, budgets,
                                 [seeds[i] if turn == 0 else derive_seed(seeds[i], turn) for i in active])
                self._observe(trajs, active, ids, envs, budgets, last=turn == self.config.max_turns - 1)
            owners = [(i, tool) for i in range(len(trajs)) for tool in self.tools.values()]
            calls = [functools.partial(_tool_reward, tool, ids[i]) for i, tool in owners]
            for (i, _), (status, value) in zip(owners, self._bounded(calls, env=False)):
                self._count(trajs[i], status, env=False)
                trajs[i].reward += value if status == "ok" else 0.0
        finally:
            self._end(trajs, ids, envs)
        return trajs

    def _start(self, trajs: list[Trajectory], ids: list[str], rows: list[Mapping[str, Any]],
               envs: list[Environment | None]) -> None:
        """Tools' ``create`` and the environments' construction + ``reset``, bounded; sets ``envs``."""
        owners = [(i, tool) for i in range(len(trajs)) for tool in self.tools.values()]
        calls = [functools.partial(_settled, tool.create, ids[i], rows[i]) for i, tool in owners]
        for (i, _), (status, _) in zip(owners, self._bounded(calls, env=False)):
            self._count(trajs[i], status, env=False)
            trajs[i].broken |= status != "ok"
        if self.environment is None:
            return
        calls = [functools.partial(_new_environment, self.environment, row) for row in rows]
        for i, (status, env) in enumerate(self._bounded(calls, env=True)):
            self._count(trajs[i], status, env=True)
            trajs[i].broken |= status != "ok"
            envs[i] = env if status == "ok" else None

    def _end(self, trajs: list[Trajectory], ids: list[str], envs: list[Environment | None]) -> None:
        """Tools' ``release`` and the environments' ``close``, bounded and counted."""
        owners = [(i, tool) for i in range(len(trajs)) for tool in self.tools.values()]
        calls = [functools.partial(_settled, tool.release, ids[i]) for i, tool in owners]
        for (i, _), (status, _) in zip(owners, self._bounded(calls, env=False)):
            self._count(trajs[i], status, env=False)
        open_envs = [(i, env) for i, env in enumerate(envs) if env is not None]
        outcomes = self._bounded([env.close for _, env in open_envs], env=True)
        for (i, _), (status, _) in zip(open_envs, outcomes):
            self._count(trajs[i], status, env=True)

    def _model_turn(self, generate: GenerateFn, prompts: list[list[int]], trajs: list[Trajectory],
                    active: list[int], config: RolloutConfig, budgets: list[int], seeds: list[int]) -> None:
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
            if traj.broken:
                traj.done = True
                continue
            calls = self._parse(traj.messages[-1]["content"]) if self.tools else []
            if calls and not traj.done:
                jobs.extend((i, c) for c in calls)
                traj.messages[-1]["tool_calls"] = [  # the calls that ran, in the chat-message shape
                    {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in calls if isinstance(c, ToolCall)]
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
        outcomes = self._bounded([functools.partial(_step, envs[i], trajs[i].messages[-1]["content"])
                                  for i in steps], env=True)
        for i, (status, result) in zip(steps, outcomes):
            self._count(trajs[i], status, env=True)
            if status != "ok":  # ends the episode with reward 0
                trajs[i].done = True
                continue
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

    def _parse(self, text: str) -> list[ToolCall | MalformedToolCall]:
        """The turn's calls, at most :data:`MAX_CALLS_PER_TURN` and one error for the rest.

        A parser that raises or returns something else (a user's) gives one malformed call, never a
        stopped run.
        """
        try:
            calls = list(self.parse(text))
        except Exception as exc:  # noqa: BLE001 - the parser's failure is the model's observation
            return [MalformedToolCall(text[:200], f"the tool calls could not be read ({type(exc).__name__})")]
        if not all(isinstance(c, (ToolCall, MalformedToolCall)) for c in calls):
            return [MalformedToolCall(text[:200], "the tool calls could not be read (the parser returned "
                                                  "something other than ToolCall / MalformedToolCall)")]
        if len(calls) > MAX_CALLS_PER_TURN:
            extra = len(calls) - MAX_CALLS_PER_TURN
            why = f"{extra} more tool calls in this turn were not run (at most {MAX_CALLS_PER_TURN} per turn)"
            calls = calls[:MAX_CALLS_PER_TURN] + [MalformedToolCall("", why)]
        return calls


def _new_environment(factory: Callable[[], Environment], row: Mapping[str, Any]) -> Environment:
    env = factory()
    env.reset(row)
    return env


def _step(env: Environment, message: str) -> StepResult:
    """``env.step(message)``; a result that is not a :class:`StepResult` raises ``TypeError``."""
    result = env.step(message)
    if not isinstance(result, StepResult):
        raise TypeError(f"{type(env).__name__}.step returned {type(result).__name__}, not a StepResult")
    float(result.reward)
    return result


def _tool_reward(tool: Tool, instance_id: str) -> float:
    return float(settle(tool.reward(instance_id)))


def _settled(method: Callable[..., Any], *args: Any) -> Any:
    """``method(*args)``, its coroutine run to the end when it is ``async``."""
    return settle(method(*args))


def agent_rewards_and_metrics(batch: TensorDict,
                              prefix: str = "agent") -> tuple[torch.Tensor, dict[str, Metric]]:
    """The trajectories' environment + tool rewards ``[B]`` and the ``agent/*`` metrics of a rollout batch.

    Metrics (real samples only, means over trajectories, reduced as ``MEAN`` weighted by the rank's real
    trajectories, so the logged value is the whole batch's over every dp rank): ``{prefix}/turns``,
    ``{prefix}/tool_calls``, ``{prefix}/tool_errors``, ``{prefix}/tool_timeouts``, ``{prefix}/env_errors``,
    ``{prefix}/env_timeouts``, ``{prefix}/env_reward``,
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

    for key in ("turns", "tool_calls", "tool_errors", "tool_timeouts", "env_errors", "env_timeouts"):
        metrics[f"{prefix}/{key}"] = mean([float(i.get(key, 0)) for i in kept])
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
