"""Preference optimisation (DPO, IPO, cDPO / robust DPO, SimPO, ORPO, KTO) of a causal LM (configs/dpo.yaml).

    python recipes/dpo.py
    python recipes/dpo.py algorithm.loss.loss_type=kto trainer.devices=2

The demo trains on pairs of the arithmetic task: the prompt, its answer (chosen) and a wrong answer
(rejected), derived from the task's SFT files into ``pref_train.jsonl`` / ``pref_val.jsonl`` when missing
(:func:`verl_trainer.data.tasks.preference_rows`). ``val/rewards/accuracies`` (the share of held-out pairs
whose chosen completion gets the larger implicit reward) and ``val/rewards/margins`` are reported before and
after. The trained model is written as an HF directory to ``export_dir`` (default ``<default_root_dir>/hf``).
"""

import functools
import sys
import time

from verl_trainer.utils.threads import apply_thread_env_defaults

apply_thread_env_defaults()  # before torch loads: OpenMP threads sleep when idle (utils/threads.py)

from verl_trainer.algorithms.preference import PreferenceModule  # noqa: E402
from verl_trainer.algorithms.preference_data import PreferenceDataModule  # noqa: E402
from verl_trainer.callbacks import ProgressBar  # noqa: E402
from verl_trainer.data.tasks import preference_rows  # noqa: E402
from verl_trainer.recipe_config import DPORecipeConfig, parse_recipe_args  # noqa: E402
from verl_trainer.recipes import common  # noqa: E402
from verl_trainer.recipes.configs import config_path  # noqa: E402
from verl_trainer.user_errors import run_command, user_setup  # noqa: E402

CONFIG = config_path("dpo")
REPORTED = ("val/rewards/accuracies", "val/rewards/margins", "val/loss")


def _data_module(cfg: DPORecipeConfig, *args, **kwargs) -> PreferenceDataModule:
    """The datamodule (pairs, or KTO's unpaired examples), after the demo's pair files exist."""
    if cfg.task.write_if_missing:
        common.write_pair_files(cfg.task.dir, "pref", preference_rows, cfg.task.arithmetic.seed)
    return PreferenceDataModule(*args, unpaired=cfg.algorithm.loss.loss_type == "kto", **kwargs)


def main(argv: list[str] | None = None) -> None:
    started = time.monotonic()
    with user_setup():  # a bad setting ends the command with its message alone (verl_trainer.user_errors)
        cfg = parse_recipe_args(DPORecipeConfig, CONFIG, argv, description=__doc__)
        trainer = cfg.trainer.build(callbacks=[ProgressBar(metrics=("pref/loss", "rewards/accuracies",
                                                                    "val/rewards/accuracies"))])
        run = common.prepare(cfg, trainer, PreferenceModule, functools.partial(_data_module, cfg))
    module, data = run.module, run.data
    before = common.validate(trainer, module, data) if cfg.trainer.validates_before_fit else None
    trainer.fit(module, datamodule=data, ckpt_path=cfg.trainer.ckpt_path)
    after = common.validate_after_fit(trainer, module, data)
    if run.export_dir:
        common.export_policy(module.engines["actor"], run.export_dir, dtype=cfg.trainer.export_torch_dtype())
    common.report(trainer, before, after, REPORTED, plot=False, started=started, exported=run.export_dir)


if __name__ == "__main__":
    sys.exit(run_command(main))
