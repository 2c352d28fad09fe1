"""An OpenEnv environment as an :class:`~verl_trainer.agents.Environment` (openenv-core 0.3).

OpenEnv's contract: a server-side ``openenv.core.env_server.interfaces.Environment`` with
``reset(seed=..., episode_id=...) -> Observation`` and ``step(action: Action) -> Observation`` (pydantic
models; the observation carries ``reward`` and ``done``), served over HTTP / WebSocket by
``openenv.core.env_server.http_server.create_app`` and reached through an ``EnvClient`` whose ``reset`` /
``step`` return ``StepResult(observation, reward, done)``. Both ends work here:

* in process: subclass :class:`OpenEnvEnvironment` and implement :meth:`~OpenEnvEnvironment.make_env`
  (return the OpenEnv ``Environment``): no server, the rollout's threads call it directly;
* as a client: implement :meth:`~OpenEnvEnvironment.make_client` instead (return a connected
  ``SyncEnvClient``, e.g. ``MyEnvClient(base_url="http://127.0.0.1:8000").sync()``): one WebSocket session
  per trajectory, closed with the trajectory.

Set :attr:`~OpenEnvEnvironment.action_cls` (the environment's ``Action`` class) and, where the text lives
elsewhere, :attr:`~OpenEnvEnvironment.action_field` / :attr:`~OpenEnvEnvironment.observation_field`, or
override :meth:`~OpenEnvEnvironment.action` / :meth:`~OpenEnvEnvironment.observation_text`. Prompts come
from :func:`openenv_rows` (one seeded ``reset`` per row, as gymnasium's adapter does); the adapter resets
with the row's seed and checks the first observation is the prompt's. Each trajectory gets its own
environment object / session; an environment that shares state between instances must say
``SUPPORTS_CONCURRENT_SESSIONS = False``, which is refused (rollouts run episodes concurrently).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

from verl_trainer.agents.environment import Environment, StepResult
from verl_trainer.environments.episodes import check_replay, episode_rows, replayed_seed

__all__ = ["EXTRA_KEY", "OpenEnvEnvironment", "openenv_rows"]

EXTRA_KEY = "openenv"
"""The ``extra_info`` key of a row's episode: ``{"seed", "observation"}``."""


def _text_field(obj: Any, name: str, what: str) -> str:
    """``obj.name`` (a typed observation) or ``obj[name]`` (``GenericEnvClient``'s dict), a ``str``."""
    value = obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)
    if not isinstance(value, str):
        raise TypeError(f"the OpenEnv {what} {type(obj).__name__} has no text field {name!r} (got "
                        f"{type(value).__name__}); set OpenEnvEnvironment.{what}_field or override "
                        f"OpenEnvEnvironment.{what}_text")
    return value


class OpenEnvEnvironment(Environment):
    """One OpenEnv episode per trajectory (see the module docstring).

    Attributes:
        action_cls: The environment's ``Action`` subclass (pydantic), built as
            ``action_cls(**{action_field: message})``.
        action_field: The action's text field.
        observation_field: The observation's text field shown to the model.
    """

    action_cls: ClassVar[type | None] = None
    action_field: ClassVar[str] = "message"
    observation_field: ClassVar[str] = "message"

    def make_env(self) -> Any:
        """In process: a new OpenEnv ``Environment`` (server side); or implement :meth:`make_client`."""
        raise NotImplementedError

    def make_client(self) -> Any:
        """As a client: a connected OpenEnv ``SyncEnvClient`` (one session per trajectory)."""
        raise NotImplementedError

    def action(self, message: str) -> Any:
        """The OpenEnv action of the model's message."""
        if self.action_cls is None:
            raise TypeError(f"{type(self).__name__}.action_cls is not set; give it the environment's Action "
                            "class or override action()")
        return self.action_cls(**{self.action_field: message.strip()})

    def observation_text(self, observation: Any) -> str:
        """The text of an OpenEnv observation shown to the model."""
        return _text_field(observation, self.observation_field, "observation")

    def _open(self) -> None:
        """Start the episode's environment or client session."""
        if type(self).make_env is not OpenEnvEnvironment.make_env:
            env = self.make_env()
            if not getattr(env, "SUPPORTS_CONCURRENT_SESSIONS", True):
                raise ValueError(f"{type(env).__name__}.SUPPORTS_CONCURRENT_SESSIONS is False: its instances "
                                 "share state, and rollouts run one instance per trajectory concurrently")
            self._env, self._client = env, None
        elif type(self).make_client is not OpenEnvEnvironment.make_client:
            self._env, self._client = None, self.make_client()
        else:
            raise TypeError(f"{type(self).__name__} implements neither make_env (in process) nor make_client "
                            "(an OpenEnv client); implement one")

    def _reset(self, seed: int) -> tuple[Any, float, bool]:
        if self._client is not None:
            result = self._client.reset(seed=seed)
            return result.observation, float(result.reward or 0.0), bool(result.done)
        obs = self._env.reset(seed=seed)
        return obs, float(obs.reward or 0.0), bool(obs.done)

    def _step(self, action: Any) -> tuple[Any, float, bool]:
        if self._client is not None:
            result = self._client.step(action)
            return result.observation, float(result.reward or 0.0), bool(result.done)
        obs = self._env.step(action)
        return obs, float(obs.reward or 0.0), bool(obs.done)

    def reset(self, row: Mapping[str, Any]) -> None:
        """Make the row's environment and reset it with the row's seed.

        Raises:
            EpisodeMismatchError: The first observation is not the row's prompt.
        """
        seed, expected, _ = replayed_seed(row, EXTRA_KEY)
        self._open()
        observation, _, _ = self._reset(seed)
        check_replay(self.observation_text(observation), expected, seed, f"OpenEnv {type(self).__name__}")

    def step(self, message: str) -> StepResult:
        """Send the message as the action; the next observation, the step's reward, and whether it ended."""
        observation, reward, done = self._step(self.action(message))
        return StepResult("" if done else self.observation_text(observation), reward, done)

    def close(self) -> None:
        """Close the episode's environment (or client session)."""
        target = getattr(self, "_client", None) or getattr(self, "_env", None)
        if target is not None:
            target.close()


def openenv_rows(adapter: type[OpenEnvEnvironment] | Callable[[], OpenEnvEnvironment], seeds: Iterable[int],
                 data_source: str | None = None, chat: bool = True) -> list[dict[str, Any]]:
    """Prompt rows, one episode per seed: the prompt is the first observation of ``adapter``'s environment.

    Raises:
        TypeError: ``adapter`` implements neither ``make_env`` nor ``make_client``, or its observations
            have no text field.
    """
    name = getattr(adapter, "__name__", type(adapter).__name__)

    def first(seed: int) -> str:
        episode = adapter()
        episode._open()
        try:
            return episode.observation_text(episode._reset(seed)[0])
        finally:
            episode.close()

    return episode_rows(first, seeds, data_source or f"openenv/{name}", EXTRA_KEY, None, chat)
