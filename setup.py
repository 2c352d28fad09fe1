"""Package layout that pyproject.toml cannot express alone.

``callbacks/`` sits at the repository root (DESIGN.md §3) and is installed as the subpackage
``verl_trainer.callbacks``, in normal and in editable installs alike.
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["verl_trainer", "verl_trainer.*"]) + ["verl_trainer.callbacks"],
    package_dir={"verl_trainer.callbacks": "callbacks"},
)
