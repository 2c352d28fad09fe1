"""Package layout that pyproject.toml cannot express alone.

Three directories sit at the repository root (docs/design.md §3) and are installed inside the package,
in normal and in editable installs alike: ``callbacks/`` as ``verl_trainer.callbacks``, ``recipes/`` as
``verl_trainer.recipes`` and ``configs/`` (the recipes' YAML files, package data) as
``verl_trainer.recipes.configs``.
"""

from setuptools import find_packages, setup

MAPPED = {"verl_trainer.callbacks": "callbacks", "verl_trainer.recipes": "recipes",
          "verl_trainer.recipes.configs": "configs"}

setup(
    packages=find_packages(include=["verl_trainer", "verl_trainer.*"]) + list(MAPPED),
    package_dir=MAPPED,
    package_data={"verl_trainer.recipes.configs": ["*.yaml"]},
)
