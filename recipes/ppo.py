"""PPO (actor + critic, GAE, critic warm-up, clipped value loss) on the arithmetic task.

    python recipes/ppo.py                                     # configs/ppo.yaml
    python recipes/ppo.py trainer.strategy=deepspeed trainer.devices=2 trainer.max_steps=10
"""

import dataclasses
import time
from pathlib import Path

import common

from verl_trainer.algorithms import PPO, PromptDataModule
from verl_trainer.callbacks import ProgressBar
from verl_trainer.configs import PPORecipeConfig, parse_recipe_args
from verl_trainer.models.loading import load_tokenizer

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "ppo.yaml"


def main() -> None:
    started = time.monotonic()
    cfg = parse_recipe_args(PPORecipeConfig, CONFIG, description=__doc__)
    common.prepare_task(cfg.task)
    policy = common.warm_start(cfg.warm_start, common.prepare_model(cfg.model), cfg.trainer)
    algorithm = dataclasses.replace(cfg.algorithm, model_path=cfg.algorithm.model_path or policy)

    module = PPO(algorithm)
    data = PromptDataModule(cfg.data, load_tokenizer(algorithm.model_path))
    trainer = cfg.trainer.build(callbacks=[ProgressBar(metrics=(*common.RL_PROGRESS, "critic/vf_loss"))])
    before = common.validate(trainer, module, data) if cfg.trainer.validates_before_fit else None
    trainer.fit(module, datamodule=data, ckpt_path=cfg.trainer.ckpt_path)
    # EXPORT_HF_SPOT (issue 13.3): export the final policy to <default_root_dir>/hf here once save_hf lands
    after = common.validate(trainer, module, data)
    common.report(trainer, before, after, ("val/reward/mean", "val/reward/accuracy"), started=started)


if __name__ == "__main__":
    main()
