"""The fit loop owns the run's progress and runs on what it is handed (no Trainer)."""

from __future__ import annotations

from datetime import timedelta

from torch.utils.data import DataLoader

from verl_trainer import Trainer
from verl_trainer.data.sharded_loader import ShardedLoader
from verl_trainer.module import TrainingModule
from verl_trainer.training.evaluation import EvaluationLoop
from verl_trainer.training.fit_loop import FitLimits, FitLoop
from verl_trainer.training.logging import MetricLogging
from verl_trainer.training.progress import Progress


class _Steps(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch.tolist())
        return {"train/loss": 1.0}


def _loop(tmp_path, progress: Progress, module: _Steps, hooks: list[str], **limits) -> FitLoop:
    settings = dict(max_steps=-1, max_epochs=None, min_steps=None, min_epochs=None, max_time=None,
                    accumulate_grad_batches=1, val_check_interval=None, check_val_every_n_epoch=None,
                    limit_train_batches=None)
    settings.update(limits)
    logging = MetricLogging(False, str(tmp_path), 1)

    def call_hook(name, *args):
        hooks.append(name)

    evaluation = EvaluationLoop(module, progress, call_hook, logging, lambda force=False: None, None)
    return FitLoop(module, progress, FitLimits(**settings), call_hook, logging, evaluation, None, [], True, 0)


def _progress(n: int = 12, batch_size: int = 2) -> Progress:
    loader = ShardedLoader(DataLoader(list(range(n)), batch_size=batch_size, shuffle=True), 0, 1, seed=3)
    return Progress(stage="fit", train_loader=loader)


def test_the_loop_advances_its_progress_and_resumes_at_the_next_batch(tmp_path):
    progress, module, hooks = _progress(), _Steps(), []
    _loop(tmp_path, progress, module, hooks, max_steps=4).run()
    assert progress.global_step == 4 and len(module.seen) == 4
    assert hooks.count("on_train_batch_end") == 4 and hooks[-2:] == ["on_train_end", "on_fit_end"]
    saved = progress.state_dict()
    assert saved == {"global_step": 4, "data": {"epoch": 0, "samples": 8}}

    resumed, rest = _progress(), _Steps()
    resumed.load_state_dict(saved)
    _loop(tmp_path, resumed, rest, [], max_steps=6).run()
    straight = _Steps()
    _loop(tmp_path, _progress(), straight, [], max_steps=6).run()
    assert module.seen + rest.seen == straight.seen and resumed.global_step == 6


def test_a_stop_request_waits_for_min_steps_and_max_epochs_ends_the_fit(tmp_path):
    progress, module = _progress(), _Steps()
    progress.should_stop = True  # as EarlyStopping sets it
    _loop(tmp_path, progress, module, [], min_steps=2).run()
    assert progress.global_step == 2
    progress, module = _progress(), _Steps()
    _loop(tmp_path, progress, module, [], max_epochs=2).run()
    assert progress.global_step == 12 and progress.current_epoch == 2


def test_max_time_stops_after_the_step_that_crossed_it(tmp_path):
    progress = _progress()
    _loop(tmp_path, progress, _Steps(), [], max_time=timedelta(seconds=0)).run()
    assert progress.global_step == 1 and progress.should_stop


def test_the_trainer_attributes_read_and_write_the_loop_progress():
    trainer = Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False)
    before = (trainer.global_step, trainer.current_epoch, trainer.should_stop, trainer.state)
    assert before == (0, 0, False, None)
    trainer.should_stop = True
    trainer.global_step = 5
    assert trainer.progress.should_stop and trainer.progress.global_step == 5
    assert trainer.peek_next_batch() is None and not trainer.validation_due()  # outside fit
