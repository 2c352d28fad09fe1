"""Cyclic garbage collection kept off the objects a test process keeps for its whole life.

Importing torch, transformers, tensordict and the project leaves ~450k objects tracked by Python's cyclic
collector; every full collection walks all of them (0.25-0.4 s on the CI machine), and imports trigger
several (~1.3 s of CPU per ``import verl_trainer.trainer``). Modules, classes and functions live as long as
the process, so collecting them is wasted work: :func:`imports_without_gc` runs imports with the collector
off and then freezes (``gc.freeze``) what exists, so later collections walk only newer objects.

Contract: reference counting frees objects as before; only unreachable cycles among frozen objects are
never collected (the process's modules, rarely garbage). Nothing a test computes depends on when the
collector runs.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["freeze_survivors", "imports_without_gc"]


@contextmanager
def imports_without_gc() -> Iterator[None]:
    """Run the body (imports) with the cyclic collector off; then freeze every live object.

    The collector is back on afterwards if it was on before, also when the body raises.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def freeze_survivors() -> None:
    """Collect the garbage now and freeze what survives (a pooled rank between two tasks)."""
    gc.collect()
    gc.freeze()
