"""``algorithm.rollout.multi_turn.server``: the settings of the OpenAI-compatible token server."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ServerConfig"]

_WHERE = "algorithm.rollout.multi_turn.server"


@dataclass
class ServerConfig:
    """Where the token server listens and how much it takes at once.

    Attributes:
        host: Address to bind (``127.0.0.1``: this machine only; bind another address only on a trusted
            network: the server has no authentication).
        port: TCP port; 0 picks a free one (the bound URL is ``TokenServer.url``).
        model_name: The name ``/v1/models`` lists; a request naming another model is a 404.
        max_concurrency: Requests admitted at once (waiting for the engine or generating); one more is
            answered ``429`` at once, so a client backs off instead of piling up.
        max_batch: Most admitted requests one engine call generates together (requests with the same
            sampling settings are batched).
        request_timeout_s: The longest a request may wait and generate; past it the answer is ``504`` and
            the turn is not recorded in its trajectory.
        max_n: Largest ``n`` (choices per request).
        seed: Base seed of requests that give neither a ``seed`` nor a trainer-registered trajectory.
    """

    host: str = "127.0.0.1"
    port: int = 0
    model_name: str = "policy"
    max_concurrency: int = 64
    max_batch: int = 32
    request_timeout_s: float = 120.0
    max_n: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"{_WHERE}.host={self.host!r} must be an address such as '127.0.0.1'")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"{_WHERE}.port={self.port!r} must be an int in [0, 65535] (0: a free port)")
        for key in ("max_concurrency", "max_batch", "max_n"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{_WHERE}.{key}={value!r} must be an int >= 1 (default "
                                 f"{getattr(type(self), key)})")
        timeout = self.request_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ValueError(f"{_WHERE}.request_timeout_s={timeout!r} must be a number of seconds in "
                             "(0, inf) "
                             f"(default {ServerConfig.request_timeout_s:g})")
