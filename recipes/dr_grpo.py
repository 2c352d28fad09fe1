"""Dr.GRPO ("GRPO done right") on the arithmetic task: GRPO without the std division, and a sequence loss
summed over tokens and divided by a constant (configs/dr_grpo.yaml).

    python recipes/dr_grpo.py
    python recipes/dr_grpo.py trainer.devices=2 trainer.max_steps=20
"""

import sys

from verl_trainer.algorithms import DrGRPO
from verl_trainer.recipes import grpo
from verl_trainer.recipes.configs import config_path
from verl_trainer.user_errors import run_command

CONFIG = config_path("dr_grpo")



def main(argv: list[str] | None = None) -> None:
    grpo.main(DrGRPO, CONFIG, argv)


if __name__ == "__main__":
    sys.exit(run_command(main))
