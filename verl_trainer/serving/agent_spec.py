"""An external agent named in ``algorithm.rollout.multi_turn.agent``: resolving it and checking the config.

Kept apart from :mod:`verl_trainer.serving.agent_loop` so the multi-turn config checks an agent without
importing the rollout package.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl_trainer.utils.registry import load_object

__all__ = ["check_agent_config", "resolve_agent"]


def resolve_agent(spec: Any) -> Callable[..., Any]:
    """The agent function ``spec`` names (``"file.py:fn"``, ``"module:fn"``) or ``spec`` itself.

    Raises:
        ValueError: A name that does not load, or an object that is not callable.
    """
    obj = load_object(spec, "agent") if isinstance(spec, str) else spec
    if not callable(obj):
        raise ValueError(f"algorithm.rollout.multi_turn.agent={spec!r} is a {type(obj).__name__}; give a "
                         "function agent(context) -> reward")
    return obj


def check_agent_config(config: Any) -> None:
    """Raise before any model loads when ``config`` (a ``MultiTurnConfig``) cannot run its agent.

    Raises:
        ValueError: The agent does not load, or tools / an environment are set beside it.
        ImportError: FastAPI or uvicorn is missing (the ``serve`` extra).
    """
    where = "algorithm.rollout.multi_turn"
    if config.tools or config.tool_config_path or config.environment is not None:
        raise ValueError(f"{where}.agent={config.agent!r} runs the whole conversation itself; unset "
                         f"{where}.tools / tool_config_path / environment (the agent calls its own tools)")
    resolve_agent(config.agent)
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"{where}.agent needs the token server's web stack: pip install "
                          f"'verl-trainer[serve]' (fastapi, uvicorn); {exc}") from exc

