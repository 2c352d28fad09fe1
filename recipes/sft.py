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
from verl_trainer.models.loading import load_tokenizer
from verl_trainer.utils.fs import ensure_replaceable

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "sft.yaml"


def main() -> None:
    started = time.monotonic()
    cfg = parse_recipe_args(SFTRecipeConfig, CONFIG, description=__doc__)
    if cfg.export_dir:
        ensure_replaceable(cfg.export_dir, "export_dir")  # before training, not after
    common.prepare_task(cfg.task)
    model_path = cfg.algorithm.model_path or common.prepare_model(cfg.model)
    algorithm = dataclasses.replace(cfg.algorithm, model_path=model_path)

    module = SFT(algorithm)
    data = SFTDataModule(cfg.data, load_tokenizer(model_path))
    trainer = cfg.trainer.build(callbacks=[ProgressBar(metrics=("sft/loss", "val/loss"))])
    has_val = bool(cfg.data.val_files)
    before = common.validate(trainer, module, data) if cfg.trainer.validates_before_fit and has_val else None
    trainer.fit(module, datamodule=data, ckpt_path=cfg.trainer.ckpt_path)
    # EXPORT_HF_SPOT (issue 13.3): export the final policy to <default_root_dir>/hf here once save_hf lands
    after = common.validate(trainer, module, data) if has_val else {}
    if cfg.export_dir:
        common.export_hf_model(module.engines["actor"], model_path, cfg.export_dir)
    common.report(trainer, before, after, ("val/loss",), plot=False, started=started)


if __name__ == "__main__":
    main()
