"""The recipes, installed as ``verl_trainer.recipes`` (``setup.py`` maps this directory; docs/design.md §3).

Each recipe runs three ways, the same code and the same YAML configs (``configs/``, shipped in the package
as :mod:`verl_trainer.recipes.configs`)::

    python recipes/grpo.py key=value ...              # a clone
    verl-trainer grpo key=value ...                   # a pip install (verl_trainer/cli.py)
    python -m verl_trainer.recipes.grpo key=value ...
"""

RECIPES = ("sft", "ppo", "grpo", "dr_grpo", "dpo", "distill", "rm", "online_dpo", "grpo_vlm")
