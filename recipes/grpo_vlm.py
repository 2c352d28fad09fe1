"""GRPO with a tiny vision-language model on the synthetic "which colour is the shape?" task (CPU, minutes).

    python recipes/grpo_vlm.py                                 # configs/grpo_vlm.yaml
    python recipes/grpo_vlm.py trainer.max_steps=60 algorithm.rollout.n=4
    verl-trainer grpo_vlm ...                                  # the same from a pip install

Writes the task's files (:mod:`verl_trainer.data.vlm_task`: 56x56 images of one coloured shape, the
question ``colour?``, the answer the colour's name) beside ``data.train_files`` and a tiny Qwen2.5-VL
(:func:`~verl_trainer.models.tiny_vlm.make_tiny_vlm`) at ``model.path`` when they are missing, then runs
``recipes/grpo.py`` with the config: a short SFT warm start on the answers (with the images), greedy
validation, GRPO with the images in every prompt (the ``shape_colour`` reward), validation again, the
trained policy exported as an HF model (``hf/``). docs/vlm.md gives the learning curve.
"""

import sys
from collections.abc import Sequence
from pathlib import Path

from verl_trainer.utils.threads import apply_thread_env_defaults

apply_thread_env_defaults()  # before torch loads: OpenMP threads sleep when idle (utils/threads.py)

from verl_trainer.data.vlm_task import write_vlm_task  # noqa: E402
from verl_trainer.models.tiny_vlm import make_tiny_vlm  # noqa: E402
from verl_trainer.recipe_config import GRPORecipeConfig, parse_recipe_args  # noqa: E402
from verl_trainer.recipes import common, grpo  # noqa: E402
from verl_trainer.recipes.configs import config_path  # noqa: E402
from verl_trainer.user_errors import run_command, user_setup  # noqa: E402

CONFIG = config_path("grpo_vlm")
TASK_FILES = ("train", "val", "sft_train", "sft_val")


def prepare_demo(cfg: GRPORecipeConfig) -> None:
    """Write the colour task (parquet) and the tiny VLM where the config reads them, when missing (rank 0).

    The task goes to ``data.train_files``' directory when that file is missing (its four files are written
    together: :func:`~verl_trainer.data.vlm_task.write_vlm_task`); the model to ``model.path`` when it holds
    no ``config.json``. Anything already there is used as it is.
    """
    train, model = Path(cfg.data.train_files), Path(cfg.model.path)
    if common.launch_rank() != 0:  # launched by torchrun: rank 0 writes, the others wait for its last files
        if train.suffix == ".parquet":
            common._wait_for(train.parent / "sft_val.parquet")
        common._wait_for(model / "preprocessor_config.json")
        return
    if not train.exists() and train.suffix == ".parquet":
        written = write_vlm_task(train.parent)
        print(f"wrote the colour task to {train.parent} ({', '.join(p.name for p in written.values())})",
              flush=True)
    if not (model / "config.json").exists():
        make_tiny_vlm(model)
        print(f"made a tiny Qwen2.5-VL at {model}", flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    """Make what the demo reads when missing, then run ``recipes/grpo.py`` with ``configs/grpo_vlm.yaml``."""
    with user_setup():
        cfg = parse_recipe_args(GRPORecipeConfig, CONFIG, argv=argv, description=__doc__)
        prepare_demo(cfg)
    grpo.main(default_config=CONFIG, argv=argv)


if __name__ == "__main__":
    sys.exit(run_command(main))
