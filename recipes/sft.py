"""SFT of a (tiny) causal LM on the arithmetic task's answers (configs/sft.yaml).

    python recipes/sft.py
    python recipes/sft.py trainer.devices=2 trainer.max_steps=100 export_dir=outputs/models/sft

The fine-tuned model is written as an HF directory to ``export_dir`` (default ``<default_root_dir>/hf``;
``trainer.export_hf=false``: none).
"""

import sys
import time

from verl_trainer.utils.threads import apply_thread_env_defaults

apply_thread_env_defaults()  # before torch loads: OpenMP threads sleep when idle (utils/threads.py)

from verl_trainer.algorithms import SFT, SFTDataModule  # noqa: E402
from verl_trainer.callbacks import ProgressBar  # noqa: E402
from verl_trainer.recipe_config import SFTRecipeConfig, parse_recipe_args  # noqa: E402
from verl_trainer.recipes import common  # noqa: E402
from verl_trainer.recipes.configs import config_path  # noqa: E402
from verl_trainer.user_errors import run_command, user_setup  # noqa: E402

CONFIG = config_path("sft")


def main(argv: list[str] | None = None) -> None:
    started = time.monotonic()
    with user_setup():  # a bad setting ends the command with its message alone (verl_trainer.user_errors)
        cfg = parse_recipe_args(SFTRecipeConfig, CONFIG, argv, description=__doc__)
        trainer = cfg.trainer.build(callbacks=[ProgressBar(metrics=("sft/loss", "val/loss"))])
        run = common.prepare(cfg, trainer, SFT, SFTDataModule)  # every check before a model loads
    module, data = run.module, run.data
    before = common.validate(trainer, module, data) if cfg.trainer.validates_before_fit else None
    trainer.fit(module, datamodule=data, ckpt_path=cfg.trainer.ckpt_path)
    after = common.validate_after_fit(trainer, module, data)
    if run.export_dir:
        common.export_policy(module.engines["actor"], run.export_dir, dtype=cfg.trainer.export_torch_dtype())
    common.report(trainer, before, after, ("val/loss",), plot=False, started=started,
                  exported=run.export_dir)


if __name__ == "__main__":
    sys.exit(run_command(main))
