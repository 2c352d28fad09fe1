"""``verl-trainer <command> [args]``: the recipes and tools by name, for a pip install (docs/design.md §3).

    verl-trainer grpo key=value ...              = python recipes/grpo.py key=value ... in a clone
    verl-trainer grpo --config dapo ...          a config shipped with the package, by name
    verl-trainer sft | ppo | dr_grpo ...         the other recipes
    verl-trainer evaluate MODEL data.val_files=...   = python -m verl_trainer.evaluate
    verl-trainer export CKPT_DIR OUT_DIR         = python -m verl_trainer.export

Also ``python -m verl_trainer <command> ...`` and ``python -m verl_trainer.recipes.<recipe> ...``. Every
command sets ``OMP_WAIT_POLICY=PASSIVE`` unless the user set ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``
(:mod:`verl_trainer.utils.threads`). The recipes read the YAML configs shipped in the package
(:mod:`verl_trainer.recipes.configs`); relative paths in them (``outputs/...``) are relative to the
directory the command runs in.

``sys.argv`` is left as it is: ``Trainer(devices=N)`` re-runs this same command line for ranks 1..N-1
(Lightning's script launcher), so the children run the same command.
"""

from __future__ import annotations

import difflib
import importlib
import sys

from verl_trainer.recipes import RECIPES
from verl_trainer.user_errors import run_command
from verl_trainer.utils.threads import apply_thread_env_defaults

TOOLS = {"evaluate": "verl_trainer.evaluate.__main__", "export": "verl_trainer.export.__main__"}
COMMANDS = {**{name: f"verl_trainer.recipes.{name}" for name in RECIPES}, **TOOLS}


def usage() -> str:
    """The command list ``verl-trainer --help`` prints."""
    from verl_trainer.recipes.configs import config_names  # lazy: 1 more module only when used

    return (f"usage: verl-trainer {{{','.join(COMMANDS)}}} [--config NAME_OR_YAML] [key=value ...]\n\n"
            f"recipes: {', '.join(RECIPES)}  (`verl-trainer grpo --help` lists a recipe's options)\n"
            f"tools:   evaluate (a model or checkpoint on a validation set), export (a checkpoint to HF)\n"
            f"configs shipped with the package (--config NAME): {', '.join(config_names())}\n")


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv[0]`` (default ``sys.argv[1:]``) with the rest of the arguments.

    Returns:
        The exit status: the command's, 0 after ``--help``, 2 for a missing or unknown command, 1 after a
        recipe's user error (a bad setting, file or package: the message alone on stderr; the traceback with
        ``VERL_TRAINER_DEBUG=1``, see :mod:`verl_trainer.user_errors`).
    """
    apply_thread_env_defaults()  # before a command imports torch: OpenMP threads sleep when idle
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if args else sys.stderr, end="")
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=2)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        print(f"verl-trainer: unknown command {name!r}{hint}\n\n{usage()}", file=sys.stderr, end="")
        return 2
    return run_command(importlib.import_module(COMMANDS[name]).main, argv=rest, prog=f"verl-trainer {name}")
