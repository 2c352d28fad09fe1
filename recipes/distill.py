"""On-policy distillation on the synthetic arithmetic task: a small student learns from a wider teacher, CPU.

    python recipes/distill.py                                         # configs/distill.yaml
    python recipes/distill.py algorithm.distill.mode=reward algorithm.distill.kl_estimator=k1 \
        algorithm.distill.top_k=0                                     # -k1 per token as a dense reward
    python recipes/distill.py algorithm.distill.top_k=0               # the reverse-KL term alone
    python recipes/distill.py algorithm.distill.teacher.model_path=path/to/teacher
    verl-trainer distill ...                                          # the same from a pip install

Without ``algorithm.distill.teacher.model_path`` the recipe makes the demo's teacher first: a wider tiny
model (``teacher.tiny``) SFT-trained on the task's answers (``teacher.sft``; reused when unchanged), and
validates it. Then, like ``recipes/grpo.py``: the student (the demo's tiny model after its short warm
start), validated before and after, trains with GRPO whose rewards (or loss) carry the per-token reverse KL
to the teacher (docs/distillation.md). Reports the teacher's, the student's before and after validation
reward, and the student -> teacher KL (``distill/reverse_kl``) over the first and last steps.
"""

import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from verl_trainer.utils.threads import apply_thread_env_defaults

apply_thread_env_defaults()  # before torch loads: OpenMP threads sleep when idle (utils/threads.py)

from verl_trainer.algorithms import GRPO, GRPOConfig, PromptDataModule  # noqa: E402
from verl_trainer.algorithms.distill import DistillGRPO, check_same_tokenizer  # noqa: E402
from verl_trainer.callbacks import Callback, ProgressBar  # noqa: E402
from verl_trainer.models.loading import load_tokenizer  # noqa: E402
from verl_trainer.models.tiny import make_tiny_model  # noqa: E402
from verl_trainer.recipe_config import parse_recipe_args  # noqa: E402
from verl_trainer.recipe_config.distill import DistillRecipeConfig  # noqa: E402
from verl_trainer.recipes import common  # noqa: E402
from verl_trainer.recipes.configs import config_path  # noqa: E402
from verl_trainer.user_errors import run_command, user_setup  # noqa: E402
from verl_trainer.utils.cached_dir import is_current, normalize  # noqa: E402
from verl_trainer.utils.fs import replace_dir_atomically  # noqa: E402

CONFIG = config_path("distill")
KL = "distill/reverse_kl"
PROGRESS = ("reward/mean", "val/reward/mean", KL, "response_length/mean")


class KLHistory(Callback):
    """Keeps ``distill/reverse_kl`` of every step (the student -> teacher KL the report shows)."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if KL in trainer.callback_metrics:
            self.values.append(float(trainer.callback_metrics[KL]))


def make_teacher(cfg: DistillRecipeConfig) -> str:
    """The demo's teacher: its tiny base (rank 0 writes it when missing or changed), then its SFT."""
    base, settings = Path(cfg.teacher.base), {"tiny": dataclasses.asdict(cfg.teacher.tiny)}
    if not is_current(base, settings):
        if common.launch_rank() == 0:
            replace_dir_atomically(base, lambda tmp: make_tiny_model(tmp, **settings["tiny"]), "tiny_model",
                                   "teacher.base", settings=normalize(settings))
        else:
            common._wait_for(base, lambda: is_current(base, settings))
    return common.warm_start(cfg.teacher.sft, str(base), cfg.trainer)


def teacher_reward(cfg: DistillRecipeConfig, teacher: str) -> dict[str, float]:
    """The teacher's validation metrics, as GRPO's validation computes them for a policy."""
    grpo = {f.name: getattr(cfg.algorithm, f.name) for f in dataclasses.fields(GRPOConfig)}
    module = GRPO(GRPOConfig(**{**grpo, "model_path": teacher}))
    trainer = cfg.trainer.build(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                default_root_dir=str(Path(cfg.trainer.default_root_dir) / "teacher_eval"))
    data = PromptDataModule(cfg.data, load_tokenizer(teacher))
    return common.validate(trainer, module, data)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the recipe (``argv``: default the command line)."""
    started = time.monotonic()
    with user_setup():  # a bad setting ends the command with its message alone (verl_trainer.user_errors)
        cfg = parse_recipe_args(DistillRecipeConfig, CONFIG, argv=argv, description=__doc__)
        common.prepare_task(cfg.task)
        teacher = cfg.algorithm.distill.teacher.model_path
    if not teacher:
        teacher = make_teacher(cfg)
        cfg.algorithm.distill.teacher.model_path = teacher
    teacher_val = teacher_reward(cfg, teacher) if cfg.teacher.validate and cfg.data.val_files else {}
    history = KLHistory()
    with user_setup():
        trainer = cfg.trainer.build(callbacks=[ProgressBar(metrics=PROGRESS), history])
        run = common.prepare(cfg, trainer, DistillGRPO, PromptDataModule)  # every check before a model loads
        check_same_tokenizer(run.base, teacher, cfg.algorithm.distill.top_k)  # the warm start keeps it
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
    if trainer.is_global_zero:
        for key in ("val/reward/mean", "val/reward/accuracy"):
            if key in teacher_val:
                print(f"teacher {key:<20} {teacher_val[key]:.4f}   ({teacher})", flush=True)
        if history.values:
            n = max(1, min(10, len(history.values) // 2))
            first, last = history.values[:n], history.values[-n:]
            print(f"{KL} (student -> teacher, per token): first {n} steps {sum(first) / n:.4f} -> last {n} "
                  f"steps {sum(last) / n:.4f}", flush=True)


if __name__ == "__main__":
    sys.exit(run_command(main))
