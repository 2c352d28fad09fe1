"""GRPO on the synthetic arithmetic task (the README's first command): tiny model, CPU, a few minutes.

    python recipes/grpo.py                                    # configs/grpo.yaml
    python recipes/grpo.py trainer.devices=2 trainer.max_steps=50 algorithm.rollout.n=4
    python recipes/grpo.py --config configs/dapo.yaml         # DAPO options on the same task

Makes the task files and a tiny model when missing, warm-starts it with a short SFT, validates on
held-out prompts, trains with GRPO, validates again, and writes the CSV, a wandb offline run and a PNG of
reward and response length per step under ``trainer.default_root_dir``.
"""

import dataclasses
import time
from pathlib import Path

import common

from verl_trainer.algorithms import GRPO, PromptDataModule
from verl_trainer.callbacks import ProgressBar
from verl_trainer.configs import GRPORecipeConfig, parse_recipe_args
from verl_trainer.models.loading import load_tokenizer

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "grpo.yaml"


def main(algorithm_cls: type = GRPO, default_config: Path = CONFIG) -> None:
    started = time.monotonic()
    cfg = parse_recipe_args(GRPORecipeConfig, default_config, description=__doc__)
    common.prepare_task(cfg.task)
    policy = common.warm_start(cfg.warm_start, common.prepare_model(cfg.model), cfg.trainer)
    algorithm = dataclasses.replace(cfg.algorithm, model_path=cfg.algorithm.model_path or policy)

    module = algorithm_cls(algorithm)
    data = PromptDataModule(cfg.data, load_tokenizer(algorithm.model_path))
    trainer = cfg.trainer.build(callbacks=[ProgressBar(metrics=common.RL_PROGRESS)])
    before = common.validate(trainer, module, data) if cfg.trainer.validates_before_fit else None
    trainer.fit(module, datamodule=data, ckpt_path=cfg.trainer.ckpt_path)
    # EXPORT_HF_SPOT (issue 13.3): export the final policy to <default_root_dir>/hf here once save_hf lands
    after = common.validate(trainer, module, data)
    actor = module.engines["actor"]
    if actor.has_adapters:  # LoRA: the adapters as a peft directory (PeftModel.from_pretrained loads it)
        actor.save_adapter(Path(cfg.trainer.default_root_dir) / "adapter")
    common.report(trainer, before, after, ("val/reward/mean", "val/reward/accuracy"), started=started)


if __name__ == "__main__":
    main()
