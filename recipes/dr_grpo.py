"""Dr.GRPO ("GRPO done right") on the arithmetic task: GRPO without the std division, and a sequence loss
summed over tokens and divided by a constant (configs/dr_grpo.yaml).

    python recipes/dr_grpo.py
    python recipes/dr_grpo.py trainer.devices=2 trainer.max_steps=20
"""

from pathlib import Path

from grpo import main

from verl_trainer.algorithms import DrGRPO

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "dr_grpo.yaml"

if __name__ == "__main__":
    main(DrGRPO, CONFIG)
