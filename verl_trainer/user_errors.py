"""A command's user errors: a bad setting, a missing file or package, found while the run is set up.

A recipe wraps its set-up (config, Trainer, data and model checks: everything before training) in
``with user_setup():``; an exception of :data:`USER_ERROR_TYPES` raised there is marked as the user's.
:func:`run_command`, the recipes' entry point (``python recipes/grpo.py``, ``verl-trainer grpo``), prints
a marked exception as its message alone on stderr, argparse-style (``grpo.py: error: <message>``), and
returns exit status 1. Anything else, and any error once ``VERL_TRAINER_DEBUG=1`` (or verl's
``HYDRA_FULL_ERROR=1``) is set, propagates with its traceback.

Called as functions (``main(argv=[...])`` in Python), the recipes raise as usual: only the command line
shortens the message.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["DEBUG_ENV", "USER_ERROR_TYPES", "is_user_error", "run_command", "user_setup"]

DEBUG_ENV = "VERL_TRAINER_DEBUG"
"""Set to 1 to see the traceback of a user error too."""
DEBUG_ENVS = (DEBUG_ENV, "HYDRA_FULL_ERROR")
"""Either one shows tracebacks (``HYDRA_FULL_ERROR``: the setting verl's Hydra entry points read)."""
USER_ERROR_TYPES: tuple[type[BaseException], ...] = (
    ValueError, TypeError, ImportError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
    FileExistsError,
)
"""The exceptions the project raises for a user's settings, files and packages (the message says the fix)."""
_MARK = "_verl_trainer_user_error"


@contextmanager
def user_setup() -> Iterator[None]:
    """Mark an exception of :data:`USER_ERROR_TYPES` raised inside as a user error, then re-raise it."""
    try:
        yield
    except USER_ERROR_TYPES as exc:
        setattr(exc, _MARK, True)
        raise


def is_user_error(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside :func:`user_setup`."""
    return bool(getattr(exc, _MARK, False))


def debug_requested() -> bool:
    """Whether the environment asks for full tracebacks (``VERL_TRAINER_DEBUG`` / ``HYDRA_FULL_ERROR``)."""
    off = ("", "0", "false", "no")
    return any(os.environ.get(name, "").strip().lower() not in off for name in DEBUG_ENVS)


def run_command(main: Callable[..., Any], *args: Any, prog: str | None = None, **kwargs: Any) -> int:
    """Run ``main(*args, **kwargs)`` as a command.

    Args:
        main: The command's function.
        args: ``main``'s positional arguments.
        prog: The command's name in the message (default: ``sys.argv[0]``'s file name).
        kwargs: ``main``'s keyword arguments (e.g. ``argv``).

    Returns:
        The exit status: ``main``'s when it returns an int, 0 when it returns anything else, 1 after a user
        error (its message printed on stderr, no traceback).

    Raises:
        BaseException: Whatever ``main`` raised that is not a user error, or any error in debug mode.
    """
    try:
        status = main(*args, **kwargs)
    except Exception as exc:
        if not is_user_error(exc) or debug_requested():
            raise
        name = prog or os.path.basename(sys.argv[0]) or "verl-trainer"
        sys.stdout.flush()
        print(f"{name}: error: {exc}\n(set {DEBUG_ENV}=1 for the traceback)", file=sys.stderr, flush=True)
        return 1
    return status if isinstance(status, int) else 0
