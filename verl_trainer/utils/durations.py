"""Durations given the way Lightning takes ``max_time``: ``"DD:HH:MM:SS"``, a ``timedelta`` or its keywords.

A plain function below every layer: the Trainer's argument check and the ``Timer`` callback both read a
duration with it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

__all__ = ["parse_max_time"]

_DHMS = re.compile(r"^(\d+):(\d{1,2}):(\d{1,2}):(\d{1,2})$")


def parse_max_time(value: Any) -> timedelta | None:
    """``max_time`` as a ``timedelta``: ``"DD:HH:MM:SS"``, a ``timedelta`` or a dict of its arguments.

    Raises:
        ValueError: Any other value, or a duration <= 0.
    """
    if value is None:
        return None
    duration = None
    if isinstance(value, timedelta):
        duration = value
    elif isinstance(value, str) and (match := _DHMS.match(value.strip())):
        d, h, m, s = (int(x) for x in match.groups())
        duration = timedelta(days=d, hours=h, minutes=m, seconds=s)
    elif isinstance(value, Mapping):
        try:
            duration = timedelta(**dict(value))
        except TypeError as exc:
            raise ValueError(
                f"max_time={dict(value)!r}: {exc}; use timedelta's keys (days, hours, ...)"
            ) from None
    if duration is None or duration.total_seconds() <= 0:
        raise ValueError(
            f"max_time={value!r}; use 'DD:HH:MM:SS' (e.g. '00:12:00:00'), a datetime.timedelta or a dict "
            "such as {'hours': 12}, longer than 0"
        )
    return duration
