"""YAML + command line → typed config dataclasses, through OmegaConf structured configs.

A recipe declares its config as a dataclass (the schema). :func:`load_config` starts from the schema's
defaults, merges a YAML file over them, then ``key=value`` overrides (dotted keys, OmegaConf's dotlist
grammar: ``algorithm.actor.optim.lr=1e-3``, ``trainer.logger=[csv]``, ``data.val_files=null``), and
builds the dataclass — so every nested config's ``__post_init__`` validation runs::

    cfg = load_config(GRPORecipeConfig, "configs/grpo.yaml", ["trainer.max_steps=10"])

Unknown keys (in the YAML or on the command line) and values of the wrong type are errors: a
``ValueError`` that names the key, where it came from and the valid keys at that level. YAML values may
use OmegaConf interpolation (``${model.path}``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence
from typing import Any, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from verl_trainer.recipe_config.demo_scope import apply_demo_scope
from verl_trainer.recipe_config.run_length import epochs_set_the_length
from verl_trainer.recipe_config.schema_keys import default_at
from verl_trainer.recipe_config.verl_keys import listed, translate_overrides
from verl_trainer.recipes.configs import config_names, config_path

__all__ = ["ConfigProblemsError", "config_to_yaml", "load_config", "parse_recipe_args",
           "resolve_config_file"]

T = TypeVar("T")


class ConfigProblemsError(ValueError):
    """Several config problems, reported together (``problems``: one line each)."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__(listed(problems))
        self.problems = list(problems)

    def __reduce__(self) -> tuple[type, tuple[list[str]]]:
        """Pickled with its own arguments (Ray and multiprocessing send errors between processes)."""
        return type(self), (self.problems,)


def _valid_keys(schema: Any, full_key: str) -> list[str]:
    """The field names at the parent level of ``full_key`` in ``schema`` (for error messages)."""
    node = default_at(schema, full_key.rpartition(".")[0])
    return sorted(f.name for f in dataclasses.fields(node)) if dataclasses.is_dataclass(node) else []


def _explain(err: OmegaConfBaseException, schema: type, source: str) -> ValueError:
    full_key = str(getattr(err, "full_key", "") or "")
    first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
    if isinstance(err, ConfigKeyError):
        valid = _valid_keys(schema, full_key)
        hint = f"; valid keys there: {', '.join(valid)}" if valid else ""
        return ValueError(f"unknown config key {full_key!r} in {source}{hint}")
    where = f" at {full_key!r}" if full_key else ""
    return ValueError(f"invalid config value{where} in {source}: {first_line}")


def _unparsable(override: str, err: BaseException) -> ValueError:
    """A malformed ``key=value``: the key and the YAML problem, without the parser's position noise."""
    key, _, value = override.partition("=")
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    problem = "; ".join(line for line in lines if not line.startswith("in ")) or type(err).__name__
    return ValueError(
        f"cannot parse the override {override!r}: the value of {key.strip()} is not valid YAML ({problem}); "
        f"close the bracket or brace, or quote the value (e.g. {key.strip()}='{value}')"
    )


def _merge(base: DictConfig, other: Any, schema: type, source: str) -> DictConfig:
    try:
        merged = OmegaConf.merge(base, other)
    except OmegaConfBaseException as err:
        raise _explain(err, schema, source) from None
    assert isinstance(merged, DictConfig)
    return merged


def _open_free_dicts(config: DictConfig) -> None:
    """Let ``dict[str, Any]`` fields (``override_optimizer_config``, ``deepspeed_config``) take new keys.

    The struct flag that makes an unknown dataclass key an error also refuses every key of a free-form
    dict (``optim.override_optimizer_config.momentum=0.9``); those nodes are opened, the rest stay closed.
    """
    for key in config:
        node = config._get_node(key)
        if isinstance(node, DictConfig) and not node._is_none() and not node._is_missing():
            if OmegaConf.get_type(node) is dict:
                OmegaConf.set_struct(node, False)
            else:
                _open_free_dicts(node)


def load_config(schema: type[T], path: str | os.PathLike | None = None,
                overrides: Sequence[str] = ()) -> T:
    """Build ``schema`` from its defaults, a YAML file and ``key=value`` overrides.

    Args:
        schema: A dataclass type (nested dataclasses allowed).
        path: A YAML file merged over the defaults (``None``: defaults only).
        overrides: ``"dotted.key=value"`` strings, applied last, in order.

    Returns:
        An instance of ``schema`` (every nested dataclass constructed, so validated).

    Raises:
        ValueError: An unknown key, a value of the wrong type, a malformed override, or a value the
            dataclass's own validation rejects; the message names the key and its source.
        FileNotFoundError: ``path`` does not exist.
    """
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        raise TypeError(f"load_config needs a dataclass type as schema, got {schema!r}")
    config = OmegaConf.structured(schema)
    OmegaConf.set_struct(config, True)
    _open_free_dicts(config)
    if path is not None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config file {os.fspath(path)!r} does not exist")
        config = _merge(config, OmegaConf.load(path), schema, f"config file {os.fspath(path)!r}")
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if bad:
        raise ValueError(f"overrides must look like key=value (e.g. trainer.max_steps=10), got {bad}")
    problems = []  # every bad override is named in one message, not one per run
    for override in overrides:
        try:
            dotlist = OmegaConf.from_dotlist([override])
        except (OmegaConfBaseException, ValueError, yaml.YAMLError) as err:
            problems.append(str(_unparsable(override, err)))
            continue
        try:
            config = _merge(config, dotlist, schema, f"the override {override!r}")
        except ValueError as err:
            problems.append(str(err))
    if problems:
        raise ConfigProblemsError(problems)
    try:
        return OmegaConf.to_object(config)  # type: ignore[return-value]
    except OmegaConfBaseException as err:
        raise _explain(err, schema, "the merged config") from None


def config_to_yaml(config: Any) -> str:
    """A dataclass instance (or type) as YAML, e.g. to print the effective config."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def resolve_config_file(given: str | os.PathLike | None) -> tuple[str | os.PathLike | None, list[str]]:
    """``--config``'s file: a YAML path as given, else the shipped config it names.

    A bare name (``dapo``) or ``configs/<name>.yaml`` that is not a file where the command runs (a pip
    install has no ``configs/`` directory) names the config shipped in the package
    (:mod:`verl_trainer.recipes.configs`); said in the returned note. Any other path must exist.

    Returns:
        The file to load and the notes to print (empty when the path was used as given).

    Raises:
        FileNotFoundError: Naming the path and listing the shipped configs.
    """
    if given is None or os.path.isfile(given):
        return given, []

    parts = os.path.normpath(os.fspath(given)).split(os.sep)
    if len(parts) == 1 or (len(parts) == 2 and parts[0] == "configs"):
        shipped = config_path(parts[-1])
        if parts == [shipped.stem]:
            return shipped, []
        return shipped, [f"--config {os.fspath(given)} is not a file here: using the config shipped with "
                         f"verl-trainer ({shipped})"]
    raise FileNotFoundError(f"config file {os.fspath(given)!r} does not exist; the configs shipped with "
                            f"verl-trainer: {', '.join(config_names())} (--config NAME)")


def parse_recipe_args(schema: type[T], default_config: str | os.PathLike | None,
                      argv: Sequence[str] | None = None, description: str = "") -> T:
    """Parse a recipe's command line: ``[--config PATH] [--print-config] key=value ...``.

    verl's override keys are accepted as aliases of ours (:mod:`verl_trainer.recipe_config.verl_keys`); each
    translation is printed once. The demo's task, validation set and warm start are turned off for a
    user's model or data (:func:`~verl_trainer.recipe_config.demo_scope.apply_demo_scope`), also printed.

    Args:
        schema: The recipe's config dataclass.
        default_config: The YAML used when ``--config`` is not given.
        argv: Arguments (default ``sys.argv[1:]``).
        description: Shown by ``--help``.

    Returns:
        The validated config. With ``--print-config`` the effective config is printed and the process
        exits.
    """
    parser = argparse.ArgumentParser(
        description=description,
        epilog="Overrides: dotted keys of the config, e.g. trainer.max_steps=10 algorithm.rollout.n=4",
    )
    parser.add_argument("--config", default=default_config,
                        help="a YAML file, or the name of a config shipped with verl-trainer "
                             "(grpo, dapo, ...; default: %(default)s)")
    parser.add_argument("--print-config", action="store_true", help="print the effective config and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    problems: list[str] = []
    try:
        overrides, verl_notes = translate_overrides(schema, args.overrides, problems)
        overrides, length_notes = epochs_set_the_length(overrides)
        config_file, shipped_note = resolve_config_file(args.config)
        try:
            config = load_config(schema, config_file, overrides)
        except ValueError as err:  # with the verl keys' problems, in one message
            raise ValueError(listed([*problems, *getattr(err, "problems", [str(err)])])) from None
        if problems:
            raise ValueError(listed(problems))
        trainer = getattr(config, "trainer", None)
        unused = trainer.unused_settings() if hasattr(trainer, "unused_settings") else []
        notes = [f"verl key: {n}" for n in verl_notes]
        notes += [f"note: {n}" for n in [*shipped_note, *length_notes, *apply_demo_scope(config), *unused]]
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    if args.print_config:
        print("".join(f"# {note}\n" for note in notes) + config_to_yaml(config))
        raise SystemExit(0)
    if notes and int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0:  # once, not per rank
        print("\n".join(notes), flush=True)
    return config
