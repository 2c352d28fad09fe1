"""The OpenAI-compatible token server and rollouts by external agents through it.

:class:`TokenServer` serves a rollout backend's ``generate_token_ids`` over HTTP (chat completions,
completions, models) with token ids and log-probs in every choice; requests tagged with a trajectory id are
recorded as sampled ids (:class:`TrajectoryStore`), so :class:`ServedAgentLoop` trains exactly the tokens an
external agent (an OpenAI client, a verifiers environment) was served. Settings: :class:`ServerConfig`;
user guide: docs/serving.md.
"""

from verl_trainer.serving.agent_loop import AgentContext, ServedAgentLoop
from verl_trainer.serving.config import ServerConfig
from verl_trainer.serving.protocol import RequestError
from verl_trainer.serving.server import TRAJECTORY_HEADER, TokenServer
from verl_trainer.serving.trajectories import Registration, TrajectoryRecord, TrajectoryStore

__all__ = ["TRAJECTORY_HEADER", "AgentContext", "Registration", "RequestError", "ServedAgentLoop",
           "ServerConfig", "TokenServer", "TrajectoryRecord", "TrajectoryStore"]
