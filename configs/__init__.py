"""The recipes' YAML configs, shipped in the package as ``verl_trainer.recipes.configs`` (package data).

A clone reads them from ``configs/`` (``setup.py`` maps this directory), a wheel from its copy inside the
package, so ``--config dapo`` and the recipes' defaults name the same files in both.
"""

from __future__ import annotations

from pathlib import Path

DIR = Path(__file__).resolve().parent


def config_names() -> list[str]:
    """The shipped configs' names (``grpo``, ``dapo``, ...), sorted."""
    return sorted(p.stem for p in DIR.glob("*.yaml"))


def config_path(name: str) -> Path:
    """The shipped config ``name`` (``"dapo"``, ``"dapo.yaml"`` or ``"configs/dapo.yaml"``).

    Raises:
        FileNotFoundError: If no shipped config has that name, listing those that exist.
    """
    stem = Path(name).name.removesuffix(".yaml").removesuffix(".yml")
    path = DIR / f"{stem}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no config {name!r} ships with verl-trainer; the shipped configs: "
                                f"{', '.join(config_names())} (or give the path of your own YAML file)")
    return path
