"""The OpenAI-compatible token server and rollouts by external agents through it.

:class:`TokenServer` serves a rollout backend's ``generate_token_ids`` over HTTP (chat completions,
completions, models) with token ids and log-probs in every choice; requests tagged with a trajectory id are
recorded as sampled ids (:class:`TrajectoryStore`), so :class:`ServedAgentLoop` trains exactly the tokens an
external agent (an OpenAI client, a verifiers environment) was served. Settings: :class:`ServerConfig`;
user guide: docs/serving.md.

Only :class:`ServerConfig` is imported with the package (the multi-turn config reads it); the rest on first
use, so importing the config does not import the rollout package.
"""

from typing import Any

from verl_trainer.serving.config import ServerConfig

_LAZY = {
    "AgentContext": "agent_loop", "ServedAgentLoop": "agent_loop", "RequestError": "protocol",
    "TRAJECTORY_HEADER": "server", "TokenServer": "server", "Registration": "trajectories",
    "TrajectoryRecord": "trajectories", "TrajectoryStore": "trajectories",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"verl_trainer.serving.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'verl_trainer.serving' has no attribute {name!r}")


__all__ = ["TRAJECTORY_HEADER", "AgentContext", "Registration", "RequestError", "ServedAgentLoop",
           "ServerConfig", "TokenServer", "TrajectoryRecord", "TrajectoryStore"]
