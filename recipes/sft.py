"""SFT of a (tiny) causal LM on the arithmetic task's answers (configs/sft.yaml).

    python recipes/sft.py
    python recipes/sft.py trainer.devices=2 trainer.max_steps=100 export_dir=outputs/models/sft

The fine-tuned model is written as an HF directory to ``export_dir`` (default ``<default_root_dir>/hf``;
``trainer.export_hf=false``: none).
"""

import dataclasses
import time
from pathlib import Path

import common

from verl_trainer.algorithms import SFT, SFTDataModule
from verl_trainer.callbacks import ProgressBar
from verl_trainer.configs import SFTRecipeConfig, parse_recipe_args
from verl_trainer.models.loading import load_tokenizer

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "sft.yaml"


def main() -> None:
    started = time.monotonic()
    cfg = parse_recipe_args(SFTRecipeConfig, CONFIG, description=__doc__)
    export_dir = common.final_export_dir(cfg.trainer, cfg.export_dir)  # refused before training, not after
    model_path = common.resolve_algorithm_model(cfg.algorithm.model_path) or common.prepare_model(cfg.model)
    common.prepare_task(cfg.task)
    algorithm = dataclasses.replace(cfg.algorithm, model_path=model_path)

    module = SFT(algorithm)
    data = SFTDataModule(cfg.data, load_tokenizer(model_path))
    trainer = cfg.trainer.build(callbacks=[ProgressBar(metrics=("sft/loss", "val/loss"))])
    has_val = bool(cfg.data.val_files)
    before = common.validate(trainer, module, data) if cfg.trainer.validate_before_fit and has_val else None
    trainer.fit(module, datamodule=data)
    after = common.validate(trainer, module, data) if has_val else {}
    if export_dir:
        common.export_policy(module.engines["actor"], export_dir)
    common.report(trainer, before, after, ("val/loss",), plot=False, started=started)


if __name__ == "__main__":
    main()
