"""A gymnasium environment with text observations and actions as an :class:`~verl_trainer.agents.Environment`.

Contract (gymnasium 1.x): ``env.reset(seed=s) -> (observation, info)`` and ``env.step(action) ->
(observation, reward, terminated, truncated, info)``, the observation a ``str`` (a ``spaces.Text``
observation space, or any space whose values :meth:`GymnasiumEnvironment.observation_text` renders) and
the action the model's message (a ``spaces.Text`` action space, or what
:meth:`GymnasiumEnvironment.action` makes of the text).

Use:

1. Register the environment with gymnasium (``gymnasium.register(id="MyText-v0", entry_point=...)``) in a
   module, so ``gymnasium.make("my_module:MyText-v0")`` imports and builds it in every process.
2. Write the prompts: :func:`gymnasium_rows` resets one environment per seed and stores its first
   observation as the prompt (``extra_info.gymnasium``: id, kwargs, seed, observation).
3. Train with ``algorithm.rollout.multi_turn.environment=verl_trainer.environments.gymnasium:
   GymnasiumEnvironment`` (or a subclass of yours): each trajectory makes the row's environment, resets it
   with the row's seed (the observation must equal the prompt's), sends each assistant message as the
   action and appends each next observation as a ``user`` message; step rewards are summed, and
   ``terminated`` or ``truncated`` ends the episode.

An action outside a ``spaces.Text`` action space (too long, characters outside its charset) is not sent:
the model gets ``invalid action: ...`` as the observation, reward 0, and the episode goes on (the turn
counts toward ``multi_turn.max_turns``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from verl_trainer.agents.environment import Environment, StepResult
from verl_trainer.environments.episodes import check_replay, episode_rows, replayed_seed

__all__ = ["EXTRA_KEY", "GymnasiumEnvironment", "gymnasium_rows", "make_env"]

EXTRA_KEY = "gymnasium"
"""The ``extra_info`` key of a row's episode: ``{"id", "kwargs", "seed", "observation"}``."""


def _gymnasium() -> Any:
    try:
        import gymnasium
    except ImportError:
        raise ImportError("verl_trainer.environments.gymnasium needs gymnasium: pip install "
                          "'verl-trainer[envs]'", name="gymnasium") from None
    return gymnasium


def make_env(env_id: str, kwargs: Mapping[str, Any] | None = None) -> Any:
    """``gymnasium.make(env_id, **kwargs)``; ``"module:Id-v0"`` imports ``module`` first (it registers).

    Raises:
        ValueError: gymnasium does not know ``env_id`` (names the registration fix).
    """
    gym = _gymnasium()
    try:
        return gym.make(env_id, **dict(kwargs or {}))
    except gym.error.Error as exc:
        raise ValueError(f"gymnasium environment {env_id!r}: {exc}; register it (gymnasium.register) in a "
                         "module and name it as 'module:Id-v0' so every process imports it") from None


def _observation_text(observation: Any) -> str:
    if not isinstance(observation, str):
        raise TypeError(f"the observation is a {type(observation).__name__}, not text; give the environment "
                        "a spaces.Text observation space or override GymnasiumEnvironment.observation_text")
    return observation


def gymnasium_rows(env_id: str, seeds: Iterable[int], kwargs: Mapping[str, Any] | None = None,
                   data_source: str | None = None, chat: bool = True) -> list[dict[str, Any]]:
    """Prompt rows, one episode per seed: the prompt is ``reset(seed=seed)``'s observation.

    Save them with :func:`verl_trainer.data.prompts.save_rows` and name the files in ``data.*_files``.

    Raises:
        ValueError: An unknown ``env_id``, or an empty observation.
        TypeError: A non-text observation.
    """
    spec = {"id": env_id, "kwargs": dict(kwargs or {})}

    def first(seed: int) -> str:
        env = make_env(env_id, kwargs)
        try:
            return _observation_text(env.reset(seed=seed)[0])
        finally:
            env.close()

    return episode_rows(first, seeds, data_source or f"gymnasium/{env_id}", EXTRA_KEY, spec, chat)


class GymnasiumEnvironment(Environment):
    """One gymnasium episode per trajectory (see the module docstring).

    Override :meth:`action` / :meth:`observation_text` for a non-text space, or :meth:`make` to build the
    environment otherwise than from the row's ``id`` and ``kwargs``.
    """

    def make(self, spec: Mapping[str, Any]) -> Any:
        """The gymnasium environment of a row's episode ``spec`` (``id``, ``kwargs``)."""
        return make_env(str(spec["id"]), spec.get("kwargs"))

    def action(self, message: str) -> Any:
        """The action the model's message stands for: the stripped text."""
        return message.strip()

    def observation_text(self, observation: Any) -> str:
        """The text shown to the model: the observation itself (a ``str`` is required)."""
        return _observation_text(observation)

    def reset(self, row: Mapping[str, Any]) -> None:
        """Make the row's environment and reset it with the row's seed.

        Raises:
            EpisodeMismatchError: The first observation is not the row's prompt.
        """
        seed, expected, spec = replayed_seed(row, EXTRA_KEY)
        self.env = self.make(spec)
        observation, _ = self.env.reset(seed=seed)
        check_replay(self.observation_text(observation), expected, seed, f"gymnasium {spec.get('id')}")

    def step(self, message: str) -> StepResult:
        """Send the message as the action; the next observation, the step's reward, and whether it ended."""
        action = self.action(message)
        space = self.env.action_space
        if isinstance(space, _gymnasium().spaces.Text) and not space.contains(action):
            return StepResult(f"invalid action: {len(action)} characters (allowed {space.min_length} to "
                              f"{space.max_length}) or characters outside the action space", 0.0, False)
        observation, reward, terminated, truncated, _ = self.env.step(action)
        done = bool(terminated or truncated)
        return StepResult("" if done else self.observation_text(observation), float(reward), done)

    def close(self) -> None:
        """Close the episode's environment (or client session)."""
        env = getattr(self, "env", None)
        if env is not None:
            env.close()
