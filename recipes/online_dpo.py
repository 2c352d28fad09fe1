"""Online DPO on the arithmetic task (configs/online_dpo.yaml): pairs sampled from the policy, labelled by
the reward.

    python recipes/online_dpo.py                                   # labels: the rule-based math reward
    python recipes/online_dpo.py algorithm.reward.model.enable=true \
        algorithm.reward.model.path=outputs/rm/hf 'algorithm.reward.weights=[0.0]'   # labels: a reward model

Each step samples ``rollout.n`` responses per prompt, scores them, pairs each prompt's best (chosen) and
worst (rejected) response and trains the DPO loss (``algorithm.loss``) against the reference; a prompt
whose responses all score the same is dropped (``online_dpo/tied_prompt_frac``). Validation is the RL
recipes' (``val/reward/*``, greedy). Setup as ``recipes/grpo.py``: the demo's tiny model, a short SFT warm
start, the trained policy exported to ``hf/`` (docs/preference.md, "Online DPO").
"""

import sys
import time

from verl_trainer.utils.threads import apply_thread_env_defaults

apply_thread_env_defaults()  # before torch loads: OpenMP threads sleep when idle (utils/threads.py)

from verl_trainer.algorithms import PromptDataModule  # noqa: E402
from verl_trainer.algorithms.online_dpo import OnlineDPO  # noqa: E402
from verl_trainer.callbacks import ProgressBar  # noqa: E402
from verl_trainer.recipe_config import parse_recipe_args  # noqa: E402
from verl_trainer.recipe_config.rm import OnlineDPORecipeConfig  # noqa: E402
from verl_trainer.recipes import common  # noqa: E402
from verl_trainer.recipes.configs import config_path  # noqa: E402
from verl_trainer.user_errors import run_command, user_setup  # noqa: E402

CONFIG = config_path("online_dpo")


def main(argv: list[str] | None = None) -> None:
    started = time.monotonic()
    with user_setup():  # a bad setting ends the command with its message alone (verl_trainer.user_errors)
        cfg = parse_recipe_args(OnlineDPORecipeConfig, CONFIG, argv=argv, description=__doc__)
        trainer = cfg.trainer.build(callbacks=[ProgressBar(metrics=("reward/mean", "pref/loss",
                                                                    "val/reward/mean"))])
        run = common.prepare(cfg, trainer, OnlineDPO, PromptDataModule)  # every check; no model yet
    if run.warm_start:
        common.warm_start(cfg.warm_start, run.base, cfg.trainer)
    module, data = run.module, run.data
    before = common.validate(trainer, module, data) if cfg.trainer.validates_before_fit else None
    trainer.fit(module, datamodule=data, ckpt_path=cfg.trainer.ckpt_path)
    after = common.validate_after_fit(trainer, module, data)
    if run.export_dir:
        common.export_policy(module.engines["actor"], run.export_dir, dtype=cfg.trainer.export_torch_dtype())
    common.report(trainer, before, after, ("val/reward/mean", "val/reward/accuracy"), started=started,
                  exported=run.export_dir)


if __name__ == "__main__":
    sys.exit(run_command(main))
