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

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from verl_trainer.configs.schema_keys import default_at
from verl_trainer.configs.verl_keys import translate_overrides

__all__ = ["config_to_yaml", "load_config", "parse_recipe_args"]

T = TypeVar("T")


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


def _merge(base: DictConfig, other: Any, schema: type, source: str) -> DictConfig:
    try:
        merged = OmegaConf.merge(base, other)
    except OmegaConfBaseException as err:
        raise _explain(err, schema, source) from None
    assert isinstance(merged, DictConfig)
    return merged


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
    if path is not None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config file {os.fspath(path)!r} does not exist")
        config = _merge(config, OmegaConf.load(path), schema, f"config file {os.fspath(path)!r}")
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if bad:
        raise ValueError(f"overrides must look like key=value (e.g. trainer.max_steps=10), got {bad}")
    for override in overrides:
        try:
            dotlist = OmegaConf.from_dotlist([override])
        except OmegaConfBaseException as err:
            raise ValueError(f"cannot parse the override {override!r}: {err}") from None
        config = _merge(config, dotlist, schema, f"the override {override!r}")
    try:
        return OmegaConf.to_object(config)  # type: ignore[return-value]
    except OmegaConfBaseException as err:
        raise _explain(err, schema, "the merged config") from None


def config_to_yaml(config: Any) -> str:
    """A dataclass instance (or type) as YAML, e.g. to print the effective config."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def parse_recipe_args(schema: type[T], default_config: str | os.PathLike | None,
                      argv: Sequence[str] | None = None, description: str = "") -> T:
    """Parse a recipe's command line: ``[--config PATH] [--print-config] key=value ...``.

    verl's override keys are accepted as aliases of ours (:mod:`verl_trainer.configs.verl_keys`); each
    translation is printed once.

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
    parser.add_argument("--config", default=default_config, help="YAML config (default: %(default)s)")
    parser.add_argument("--print-config", action="store_true", help="print the effective config and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        overrides, notes = translate_overrides(schema, args.overrides)
        config = load_config(schema, args.config, overrides)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    if args.print_config:
        print("".join(f"# verl key: {note}\n" for note in notes) + config_to_yaml(config))
        raise SystemExit(0)
    if notes and int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0:  # once, not per rank
        print("\n".join(f"verl key: {note}" for note in notes), flush=True)
    return config
