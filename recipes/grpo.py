"""GRPO on the synthetic arithmetic task (the README's first command): tiny model, CPU, a few minutes.

    python recipes/grpo.py                                    # configs/grpo.yaml
    python recipes/grpo.py trainer.devices=2 trainer.max_steps=50 algorithm.rollout.n=4
    python recipes/grpo.py --config configs/dapo.yaml         # DAPO options on the same task
    verl-trainer grpo --config dapo ...                       # the same from a pip install

Makes the task files and (demo only) a tiny model when missing, warm-starts it with a short SFT, validates
on held-out prompts, trains with GRPO, validates again, and writes the CSV, a wandb offline run, a PNG of
reward and response length per step and the trained policy as an HF model (``hf/``) under
``trainer.default_root_dir``.
"""

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from verl_trainer.utils.threads import apply_thread_env_defaults

apply_thread_env_defaults()  # before torch loads: OpenMP threads sleep when idle (utils/threads.py)

from verl_trainer.algorithms import GRPO, PromptDataModule  # noqa: E402
from verl_trainer.callbacks import Callback, ProgressBar  # noqa: E402
from verl_trainer.recipe_config import GRPORecipeConfig, parse_recipe_args  # noqa: E402
from verl_trainer.recipes import common  # noqa: E402
from verl_trainer.recipes.configs import config_path  # noqa: E402
from verl_trainer.rollout_pool.current import is_rollout_rank  # noqa: E402
from verl_trainer.user_errors import run_command, user_setup  # noqa: E402

CONFIG = config_path("grpo")


def main(algorithm_cls: type[GRPO] = GRPO, default_config: Path = CONFIG, argv: Sequence[str] | None = None,
         callbacks: Sequence[Callback] = ()) -> None:
    """Run the recipe; ``argv`` (default: the command line) and extra ``callbacks`` are for launchers such as
    ``examples/ray_grpo.py``."""
    started = time.monotonic()
    with user_setup():  # a bad setting ends the command with its message alone (verl_trainer.user_errors)
        cfg = parse_recipe_args(GRPORecipeConfig, default_config, argv=argv, description=__doc__)
        trainer = cfg.trainer.build(callbacks=[ProgressBar(metrics=common.RL_PROGRESS), *callbacks])
        run = common.prepare(cfg, trainer, algorithm_cls, PromptDataModule)  # every check; no model yet
    if run.warm_start:
        common.warm_start(cfg.warm_start, run.base, cfg.trainer)
    module, data = run.module, run.data
    before = common.validate(trainer, module, data) if cfg.trainer.validates_before_fit else None
    trainer.fit(module, datamodule=data, ckpt_path=cfg.trainer.ckpt_path)
    if is_rollout_rank():  # a separate pool's rollout worker under Ray Train: the rest is the trainers'
        return
    after = common.validate_after_fit(trainer, module, data)
    actor = module.engines["actor"]
    if actor.has_adapters:  # LoRA: the adapters as a peft directory (PeftModel.from_pretrained loads it)
        actor.save_adapter(Path(cfg.trainer.default_root_dir) / "adapter")
    if run.export_dir:  # the trained policy as a plain HF model (LoRA merged)
        common.export_policy(actor, run.export_dir, dtype=cfg.trainer.export_torch_dtype())
    common.report(trainer, before, after, ("val/reward/mean", "val/reward/accuracy"), started=started,
                  exported=run.export_dir)


if __name__ == "__main__":
    sys.exit(run_command(main))
