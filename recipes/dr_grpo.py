"""Dr.GRPO ("GRPO done right") on the arithmetic task: GRPO without the std division, and a sequence loss
summed over tokens and divided by a constant (configs/dr_grpo.yaml).

    python recipes/dr_grpo.py
    python recipes/dr_grpo.py trainer.devices=2 trainer.max_steps=20
"""

import sys

from verl_trainer.utils.threads import apply_thread_env_defaults

apply_thread_env_defaults()  # before torch loads: OpenMP threads sleep when idle (utils/threads.py)

from verl_trainer.algorithms import DrGRPO  # noqa: E402
from verl_trainer.recipes import grpo  # noqa: E402
from verl_trainer.recipes.configs import config_path  # noqa: E402
from verl_trainer.user_errors import run_command  # noqa: E402

CONFIG = config_path("dr_grpo")



def main(argv: list[str] | None = None) -> None:
    grpo.main(DrGRPO, CONFIG, argv)


if __name__ == "__main__":
    sys.exit(run_command(main))
