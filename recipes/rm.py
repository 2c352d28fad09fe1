"""Reward-model training (Bradley–Terry) on preference pairs (configs/rm.yaml).

    python recipes/rm.py
    python recipes/rm.py trainer.devices=2 data.train_files=my_pairs.jsonl data.val_files=null model.path=...

The demo trains a sequence-classification head on the tiny model over pairs of the arithmetic task: the
prompt with its answer (chosen) against every other number up to 19 and malformed responses (rejected:
the empty response, zeros, a stray digit, the answer twice; :mod:`verl_trainer.data.reward_task`),
``rm_train.jsonl`` / ``rm_val.jsonl`` derived from the task's SFT files when missing. ``val/rm/accuracy``
(the share of held-out pairs the model ranks right) and ``val/rm/margin`` are reported before and after.
The reward model is written to ``export_dir`` (default ``<default_root_dir>/hf``) as a
``*ForSequenceClassification`` directory: ``python recipes/grpo.py algorithm.reward.model.enable=true
algorithm.reward.model.path=<it>`` scores with it (docs/reward_models.md).
"""

import functools
import sys
import time

from verl_trainer.utils.threads import apply_thread_env_defaults

apply_thread_env_defaults()  # before torch loads: OpenMP threads sleep when idle (utils/threads.py)

from verl_trainer.algorithms.reward_training import (  # noqa: E402
    REWARD_ENGINE,
    RewardModelDataModule,
    RewardModelModule,
    save_reward_model,
)
from verl_trainer.callbacks import ProgressBar  # noqa: E402
from verl_trainer.data.reward_task import reward_model_rows  # noqa: E402
from verl_trainer.recipe_config import parse_recipe_args  # noqa: E402
from verl_trainer.recipe_config.rm import RMRecipeConfig  # noqa: E402
from verl_trainer.recipes import common  # noqa: E402
from verl_trainer.recipes.configs import config_path  # noqa: E402
from verl_trainer.user_errors import run_command, user_setup  # noqa: E402

CONFIG = config_path("rm")
REPORTED = ("val/rm/accuracy", "val/rm/margin", "val/loss")


def _data_module(cfg: RMRecipeConfig, *args, **kwargs) -> RewardModelDataModule:
    """The datamodule, after the demo's pair files exist."""
    if cfg.task.write_if_missing:
        common.write_pair_files(cfg.task.dir, "rm", reward_model_rows, cfg.task.arithmetic.seed)
    return RewardModelDataModule(*args, **kwargs)


def main(argv: list[str] | None = None) -> None:
    started = time.monotonic()
    with user_setup():  # a bad setting ends the command with its message alone (verl_trainer.user_errors)
        cfg = parse_recipe_args(RMRecipeConfig, CONFIG, argv, description=__doc__)
        trainer = cfg.trainer.build(callbacks=[ProgressBar(metrics=("rm/loss", "rm/accuracy",
                                                                    "val/rm/accuracy"))])
        run = common.prepare(cfg, trainer, RewardModelModule, functools.partial(_data_module, cfg))
    module, data = run.module, run.data
    before = common.validate(trainer, module, data) if cfg.trainer.validates_before_fit else None
    trainer.fit(module, datamodule=data, ckpt_path=cfg.trainer.ckpt_path)
    after = common.validate_after_fit(trainer, module, data)
    if run.export_dir:
        dtype = cfg.trainer.export_torch_dtype()
        save_reward_model(module.engines[REWARD_ENGINE], run.export_dir, dtype=dtype)
    common.report(trainer, before, after, REPORTED, plot=False, started=started)
    if run.export_dir and trainer.is_global_zero:
        print(f"reward model: {run.export_dir}  (AutoModelForSequenceClassification loads it; "
              f"algorithm.reward.model.path={run.export_dir})", flush=True)


if __name__ == "__main__":
    sys.exit(run_command(main))
