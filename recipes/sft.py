"""SFT of a (tiny) causal LM on the arithmetic task's answers (configs/sft.yaml).

    python recipes/sft.py
    python recipes/sft.py trainer.devices=2 trainer.max_steps=100 export_dir=outputs/models/sft
"""

import dataclasses
import time
from pathlib import Path

import common

from verl_trainer.algorithms import SFT, SFTDataModule
from verl_trainer.callbacks import ProgressBar
from verl_trainer.configs import SFTRecipeConfig, parse_recipe_args
from verl_trainer.utils.fs import ensure_replaceable

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "sft.yaml"


def main() -> None:
    started = time.monotonic()
    cfg = parse_recipe_args(SFTRecipeConfig, CONFIG, description=__doc__)
    if cfg.export_dir:
        ensure_replaceable(cfg.export_dir, "export_dir")  # before training, not after
    trainer = cfg.trainer.build(callbacks=[ProgressBar(metrics=("sft/loss", "val/loss"))])
    module = SFT(dataclasses.replace(cfg.algorithm, model_path=common.policy_path(cfg)))
    data = common.prepare(cfg, trainer, module, SFTDataModule)  # every check before a model loads
    before = common.validate(trainer, module, data) if cfg.trainer.validate_before_fit else None
    trainer.fit(module, datamodule=data)
    after = common.validate(trainer, module, data)
    if cfg.export_dir:
        common.export_hf_model(module.engines["actor"], module.config.model_path, cfg.export_dir)
    common.report(trainer, before, after, ("val/loss",), plot=False, started=started)


if __name__ == "__main__":
    main()
