"""PPO (actor + critic, GAE, critic warm-up, clipped value loss) on the arithmetic task.

    python recipes/ppo.py                                     # configs/ppo.yaml
    python recipes/ppo.py trainer.strategy=deepspeed trainer.devices=2 trainer.max_steps=10
"""

import sys
import time

from verl_trainer.utils.threads import apply_thread_env_defaults

apply_thread_env_defaults()  # before torch loads: OpenMP threads sleep when idle (utils/threads.py)

from verl_trainer.algorithms import PPO, PromptDataModule  # noqa: E402
from verl_trainer.callbacks import ProgressBar  # noqa: E402
from verl_trainer.recipe_config import PPORecipeConfig, parse_recipe_args  # noqa: E402
from verl_trainer.recipes import common  # noqa: E402
from verl_trainer.recipes.configs import config_path  # noqa: E402
from verl_trainer.user_errors import run_command, user_setup  # noqa: E402

CONFIG = config_path("ppo")


def main(argv: list[str] | None = None) -> None:
    started = time.monotonic()
    with user_setup():  # a bad setting ends the command with its message alone (verl_trainer.user_errors)
        cfg = parse_recipe_args(PPORecipeConfig, CONFIG, argv, description=__doc__)
        trainer = cfg.trainer.build(callbacks=[ProgressBar(metrics=(*common.RL_PROGRESS, "critic/vf_loss"))])
        run = common.prepare(cfg, trainer, PPO, PromptDataModule)  # every check before a model loads
    if run.warm_start:
        common.warm_start(cfg.warm_start, run.base, cfg.trainer)
    module, data = run.module, run.data
    before = common.validate(trainer, module, data) if cfg.trainer.validates_before_fit else None
    trainer.fit(module, datamodule=data, ckpt_path=cfg.trainer.ckpt_path)
    after = common.validate_after_fit(trainer, module, data)
    if run.export_dir:  # the trained policy as a plain HF model
        common.export_policy(module.engines["actor"], run.export_dir, dtype=cfg.trainer.export_torch_dtype())
    common.report(trainer, before, after, ("val/reward/mean", "val/reward/accuracy"), started=started,
                  exported=run.export_dir)


if __name__ == "__main__":
    sys.exit(run_command(main))
