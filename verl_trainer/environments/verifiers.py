"""verifiers environments as agents over the token server (``algorithm.rollout.multi_turn.agent``).

A verifiers chat environment without tools (``vf.SingleTurnEnv``, ``vf.MultiTurnEnv`` subclasses of the
classic stack: ``import verifiers as vf`` in verifiers 0.3.x, the package's ``verifiers.legacy``) runs its own
rollout loop against an OpenAI client and scores the result with its ``Rubric``. :class:`VerifiersAgent`
runs that loop for one dataset row per trajectory, in process, with an ``AsyncOpenAI`` client on the
trainer's token server (``AgentContext.base_url``) whose every request carries the ``X-Trajectory-Id``
header, and returns the rubric's reward, which the served agent loop takes as the trajectory's reward
(weighted by ``multi_turn.reward_weight`` and added to ``algorithm.reward.name``'s score).

The trainer's prompt dataset comes from the environment's own dataset: :func:`verifiers_rows` turns each
formatted example (its ``prompt`` messages, ``answer``, ``info``, ``example_id``) into a verl row whose
``extra_info[VERIFIERS_INPUT]`` holds the rollout input as JSON, so the agent sends exactly the messages
the trainer rendered as the first prompt.

verifiers 0.4.0 ships only the harness stack (``verifiers.v1``: each episode a program prepared with ``uv``
in a runtime, behind its own interception server), which has no in-process rollout; it is refused with the
install line of 0.3.1.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from verl_trainer.data.prompts import to_verl_row

if TYPE_CHECKING:
    from verl_trainer.serving import AgentContext

__all__ = ["VERIFIERS_INPUT", "VERIFIERS_PIN", "VerifiersAgent", "require_verifiers", "verifiers_rows"]

VERIFIERS_INPUT = "verifiers_input"
"""The ``extra_info`` key of a row's verifiers rollout input (JSON: prompt, answer, info, example_id)."""
VERIFIERS_PIN = "verifiers==0.3.1"
"""The tested release with the classic (in-process) environment classes."""
_INPUT_KEYS = ("prompt", "answer", "info", "task", "example_id")


def require_verifiers() -> Any:
    """The ``verifiers`` module with its classic environment stack (``vf.Environment``).

    Raises:
        ImportError: verifiers is not installed, or the installed release has only the harness stack.
    """
    try:
        import verifiers as vf
    except ImportError as exc:
        raise ImportError(f"verl_trainer.environments.verifiers needs verifiers: pip install "
                          f"'{VERIFIERS_PIN}' (or the 'verifiers' extra); {exc}") from exc
    try:
        vf.Environment  # noqa: B018  (0.4.0 has only verifiers.v1)
    except AttributeError as exc:
        raise ImportError(
            f"verifiers {getattr(vf, '__version__', '?')} has no in-process environments (vf.Environment; "
            f"its verifiers.v1 harness runs each episode as a program built with uv); pip install "
            f"'{VERIFIERS_PIN}'") from exc
    return vf


def _check_environment(env: Any, vf: Any) -> None:
    if not isinstance(env, vf.Environment):
        raise TypeError(f"VerifiersAgent got {type(env).__name__}; give a verifiers environment "
                        "(vf.SingleTurnEnv, a vf.MultiTurnEnv subclass) or a function returning one")
    name = type(env).__name__
    if getattr(env, "message_type", "chat") != "chat":
        raise ValueError(f"{name} has message_type={env.message_type!r}; only 'chat' environments run over "
                         "the token server (its first prompt must be the dataset prompt the trainer "
                         "rendered with the chat template); build the environment with message_type='chat'")
    if env.requires_group_rollouts or env.provides_advantages:
        raise ValueError(f"{name}'s rubric scores whole groups (group reward functions or advantages); the "
                         "trainer runs one rollout per trajectory and computes advantages itself: use "
                         "per-rollout reward functions")
    if getattr(env, "tool_defs", None):
        raise ValueError(f"{name} has tools ({[t.name for t in env.tool_defs]}); tool environments do not "
                         "run over the token server yet: it renders no tools into the dataset prompt and "
                         "parses no tool calls from replies; use a MultiTurnEnv whose env_response reads the "
                         "reply text")
    if getattr(env, "env_client", None) is not None:
        raise ValueError(f"{name} runs in server mode (env_client set); give the in-process environment")


def verifiers_rows(env: Any, n: int = -1, seed: int | None = None,
                   split: str = "train") -> list[dict[str, Any]]:
    """Prompt rows (``data.train_files`` / ``val_files`` via ``save_rows``) of ``env``'s dataset.

    Each row: ``prompt`` the example's chat messages (system prompt and few-shot included, ``None`` fields
    dropped), ``reward_model.ground_truth`` its ``answer``, ``data_source`` ``verifiers/<env class>``,
    ``extra_info[VERIFIERS_INPUT]`` the rollout input as JSON.

    Args:
        env: A verifiers environment.
        n: The first ``n`` examples (-1: all).
        seed: Shuffle first with this seed.
        split: ``"train"`` (``env.get_dataset``) or ``"eval"`` (``env.get_eval_dataset``).

    Raises:
        ValueError: An unknown split, or a message whose content is not text.
    """
    vf = require_verifiers()
    _check_environment(env, vf)
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}; choose 'train' or 'eval'")
    dataset = env.get_dataset(n, seed) if split == "train" else env.get_eval_dataset(n, seed)
    rows = []
    for example in dataset:
        info = example.get("info")
        if isinstance(info, dict) and info.get("tool_defs"):
            raise ValueError(f"example {example.get('example_id')} of {type(env).__name__} has "
                             "info['tool_defs']; tool environments do not run over the token server yet")
        messages = [_plain_message(m) for m in example["prompt"]]
        record = {k: example[k] for k in _INPUT_KEYS if k in example}
        record["prompt"] = messages
        rows.append(to_verl_row(messages, example.get("answer", ""), f"verifiers/{type(env).__name__}",
                                {VERIFIERS_INPUT: json.dumps(record)}, ability="verifiers"))
    return rows


def _plain_message(message: Any) -> dict[str, Any]:
    message = dict(message)
    if not isinstance(message.get("content"), str):
        raise ValueError(f"verifiers prompt message {message!r} has non-text content; the token server "
                         "takes text messages only")
    return {k: v for k, v in message.items() if v is not None}


class VerifiersAgent:
    """The ``multi_turn.agent`` that runs a verifiers environment's rollout per trajectory.

    ``agent = VerifiersAgent(load_environment)`` in ``my_env.py``, then
    ``algorithm.rollout.multi_turn.agent=my_env.py:agent`` and ``data.train_files`` rows from
    :func:`verifiers_rows` of the same environment.

    Args:
        env: A verifiers environment, or a function returning one (called once, here).
        sampling_args: Passed to each request (``max_tokens`` can lower a turn's share; the server samples
            with the trainer's temperature / top-p / top-k and refuses ``stop``).
        raise_on_error: A rollout that verifiers ended with an error (a refused request, a tool that
            raised) raises, so the trajectory counts in ``agent/env_errors`` (reward 0, its turns kept);
            ``False`` returns the rubric's reward of the partial rollout instead. An empty model reply (eos
            first) is no error: verifiers ends the rollout there and the rubric scores it.

    Raises:
        ImportError: verifiers is missing or has no in-process environments (see :func:`require_verifiers`).
        TypeError / ValueError: ``env`` is not a chat environment scored per rollout.
    """

    def __init__(self, env: Any | Callable[[], Any], sampling_args: dict[str, Any] | None = None,
                 raise_on_error: bool = True) -> None:
        self.vf = require_verifiers()
        if callable(env) and not isinstance(env, self.vf.Environment):
            env = env()
        _check_environment(env, self.vf)
        self.env = env
        self.sampling_args = dict(sampling_args or {})
        self.raise_on_error = raise_on_error

    async def __call__(self, context: AgentContext) -> float:
        """Run one rollout of the row's example; returns the rubric's reward.

        Raises:
            ValueError: The row has no ``extra_info[VERIFIERS_INPUT]``.
            RuntimeError: verifiers ended the rollout with an error (``raise_on_error``).
        """
        from openai import AsyncOpenAI

        extra = context.row.get("extra_info") or {}
        if VERIFIERS_INPUT not in extra:
            raise ValueError(f"row {dict(context.row)!r} has no extra_info[{VERIFIERS_INPUT!r}]; build the "
                             "dataset with verl_trainer.environments.verifiers.verifiers_rows(env)")
        rollout_input = json.loads(extra[VERIFIERS_INPUT])
        openai = AsyncOpenAI(base_url=context.base_url, api_key="token-server", max_retries=0,
                             default_headers=context.headers)
        try:
            client = self.vf.OpenAIChatCompletionsClient(openai)
            output = await self.env.run_rollout(rollout_input, client, context.model,
                                                dict(self.sampling_args))
        finally:
            await openai.close()
        output = dict(output)
        error = output.get("error")
        if error is not None and self.raise_on_error and not _empty_reply(error):
            raise RuntimeError(f"verifiers ended the rollout of example {rollout_input.get('example_id')} "
                               f"with an error: {error}")
        return float(output.get("reward") or 0.0)


def _empty_reply(error: Any) -> bool:
    """Whether verifiers' rollout error is an empty model reply (the policy sampled eos first).

    That is a sampled turn the trainer keeps and the rubric scores, not an environment failure.
    """
    if isinstance(error, BaseException):
        return type(error).__name__ == "EmptyModelResponseError"
    return isinstance(error, dict) and "EmptyModelResponseError" in map(str, error.values())
