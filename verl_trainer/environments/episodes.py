"""Seeded episodes of a reset/step environment as prompt rows, and the check that a rollout replays them.

An environment of another library (gymnasium, OpenEnv) starts an episode with ``reset(seed)``, which
returns the first observation; here the prompt is data read before the rollout. So the prompt rows are made
offline: :func:`episode_rows` resets one environment per seed and writes its first observation as the
prompt, the seed and the observation under ``extra_info[key]``. At rollout time the adapter resets a fresh
environment with the row's seed and :func:`replayed_seed` checks the first observation is the prompt's
(a non-deterministic ``reset`` would train the model on a prompt that is not its episode's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from verl_trainer.data.prompts import to_verl_row

__all__ = ["EpisodeMismatchError", "check_replay", "episode_rows", "replayed_seed"]


class EpisodeMismatchError(RuntimeError):
    """The environment's first observation for a row's seed is not the row's prompt."""


def episode_rows(first_observation: Callable[[int], str], seeds: Iterable[int], data_source: str, key: str,
                 spec: Mapping[str, Any] | None = None, chat: bool = True) -> list[dict[str, Any]]:
    """One verl prompt row per seed: the prompt is ``first_observation(seed)``.

    Args:
        first_observation: Resets a fresh environment with the seed and returns its first observation text.
        seeds: Episode seeds (one row each, in order).
        data_source: The rows' ``data_source``.
        key: ``extra_info`` key of the episode (``{"seed", "observation", **spec}``).
        spec: More JSON-able fields stored with the episode (the adapter reads them back at ``reset``).
        chat: Prompts as a one-message chat list (``user``), else the text.

    Returns:
        verl rows, ground truth ``None`` (the environment's rewards score the episode).
    """
    rows = []
    for index, seed in enumerate(seeds):
        text = first_observation(int(seed))
        if not isinstance(text, str) or not text:
            raise ValueError(f"{data_source}: reset(seed={seed}) gave the observation {text!r}; the prompt "
                             "needs a non-empty text observation")
        prompt: Any = [{"role": "user", "content": text}] if chat else text
        episode = {**dict(spec or {}), "seed": int(seed), "observation": text}
        rows.append(to_verl_row(prompt, None, data_source, {"index": index, key: episode}, ability="agent"))
    return rows


def replayed_seed(row: Mapping[str, Any], key: str) -> tuple[int, str, dict[str, Any]]:
    """``(seed, first observation, episode spec)`` of a row made by :func:`episode_rows`.

    Raises:
        ValueError: The row has no ``extra_info[key]`` (not made by :func:`episode_rows`).
    """
    extra = row.get("extra_info") or {}
    episode = extra.get(key)
    if not isinstance(episode, Mapping) or "seed" not in episode or "observation" not in episode:
        raise ValueError(f"the prompt row has no extra_info.{key} with seed and observation; make the prompt "
                         f"files with the adapter's rows function (extra_info keys: {sorted(extra)})")
    return int(episode["seed"]), str(episode["observation"]), dict(episode)


def check_replay(observation: str, expected: str, seed: int, what: str) -> None:
    """Raise :class:`EpisodeMismatchError` when ``observation`` (a fresh reset) differs from the prompt's."""
    if observation != expected:
        raise EpisodeMismatchError(
            f"{what}: reset(seed={seed}) gave {observation[:80]!r}, but the prompt row holds "
            f"{expected[:80]!r}; the environment's reset must be deterministic given the seed (regenerate "
            "the prompt files after changing the environment)")
