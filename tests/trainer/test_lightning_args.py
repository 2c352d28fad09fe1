"""Lightning's Trainer arguments: values checked at construction, names with no meaning here rejected with
what to use instead, Lightning's callbacks rejected naming ours, hooks never called found (no fit: fast)."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest

from verl_trainer import Trainer
from verl_trainer.callbacks import HOOK_NAMES, Callback, EarlyStopping, ModelCheckpoint
from verl_trainer.callbacks.base import unknown_hooks
from verl_trainer.data.loader_position import limited_batches
from verl_trainer.training.lightning_compat import HARMLESS_VALUES, UNSUPPORTED_ARGS
from verl_trainer.utils.durations import parse_max_time

# Every Lightning 2.x callback hook; each must be dispatched here.
LIGHTNING_CALLBACK_HOOKS = [
    "setup", "teardown", "on_fit_start", "on_fit_end", "on_sanity_check_start", "on_sanity_check_end",
    "on_train_batch_start", "on_train_batch_end", "on_train_epoch_start", "on_train_epoch_end",
    "on_validation_epoch_start", "on_validation_epoch_end", "on_test_epoch_start", "on_test_epoch_end",
    "on_predict_epoch_start", "on_predict_epoch_end", "on_validation_batch_start", "on_validation_batch_end",
    "on_test_batch_start", "on_test_batch_end", "on_predict_batch_start", "on_predict_batch_end",
    "on_train_start", "on_train_end", "on_validation_start", "on_validation_end", "on_test_start",
    "on_test_end", "on_predict_start", "on_predict_end", "on_exception", "on_save_checkpoint",
    "on_load_checkpoint", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
    "on_before_zero_grad",
]


def test_every_lightning_callback_hook_is_a_hook():
    assert sorted(set(LIGHTNING_CALLBACK_HOOKS) - HOOK_NAMES) == []


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_ARGS))
def test_lightning_args_without_meaning_say_what_to_use(name):
    if name in HARMLESS_VALUES:  # accepted at the values that ask for what happens here anyway
        fix = re.escape(UNSUPPORTED_ARGS[name][:20])
        match = f"{name}='on': Lightning's argument is accepted here only as .*{fix}"
    else:
        match = f"{name}: Lightning's argument has no meaning here; "
    with pytest.raises(TypeError, match=match):
        Trainer(**{name: "on"})


def test_harmless_lightning_flags_are_accepted_at_their_defaults():
    """What a Lightning script passes by habit (issue 29 item 7): its defaults, and the flags that change
    nothing here at any value."""
    Trainer(enable_model_summary=False, benchmark=None, inference_mode=True, use_distributed_sampler=True,
            detect_anomaly=False, sync_batchnorm=False, barebones=False, reload_dataloaders_every_n_epochs=0,
            profiler=None, plugins=None, overfit_batches=0.0, model_registry=None, logger=False)
    Trainer(enable_model_summary=True, inference_mode=False, benchmark=False, logger=False)
    with pytest.raises(TypeError, match=r"use_distributed_sampler=False: .*accepted here only as True"):
        Trainer(use_distributed_sampler=False)
    with pytest.raises(TypeError, match=r"overfit_batches=5: .*accepted here only as 0 or 0.0"):
        Trainer(overfit_batches=5)


def test_misspelled_argument_suggests_the_name():
    with pytest.raises(TypeError, match="max_step: not a Trainer argument; did you mean max_steps"):
        Trainer(max_step=3)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"accumulate_grad_batches": 0}, "accumulate_grad_batches=0; use an int >= 1"),
    ({"accumulate_grad_batches": {0: 2}}, "a schedule that changes it by epoch is not supported"),
    ({"gradient_clip_val": -1.0}, "gradient_clip_val=-1.0; use a number >= 0"),
    ({"gradient_clip_val": 1.0, "gradient_clip_algorithm": "value"},
     "gradient_clip_algorithm='value' is not supported.*use gradient_clip_algorithm='norm'"),
    ({"limit_train_batches": 1.5}, "limit_train_batches=1.5; use an int >= 0"),
    ({"limit_val_batches": -1}, "limit_val_batches=-1"),
    ({"val_check_interval": 0.0}, "val_check_interval=0.0; use an int >= 1.*a float in \\(0, 1\\]"),
    ({"val_check_interval": 1.5}, "val_check_interval=1.5"),
    ({"check_val_every_n_epoch": 0}, "check_val_every_n_epoch=0; use None or an int >= 1"),
    ({"num_sanity_val_steps": -2}, "num_sanity_val_steps=-2; use None or an int >= -1"),
    ({"min_steps": -1}, "min_steps=-1"),
    ({"max_time": "12 hours"}, "max_time='12 hours'; use 'DD:HH:MM:SS'"),
    ({"max_time": {"hour": 1}}, "max_time=.*use timedelta's keys"),
    ({"deterministic": "yes"}, "deterministic='yes'; use True, False or 'warn'"),
    ({"fast_dev_run": -1}, "fast_dev_run=-1"),
])
def test_bad_lightning_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Trainer(**kwargs)


def test_lightning_values_accepted():
    t = Trainer(accumulate_grad_batches=4, gradient_clip_val=0.5, gradient_clip_algorithm="norm",
                limit_train_batches=0.25, limit_val_batches=3, val_check_interval=0.5,
                check_val_every_n_epoch=2,
                num_sanity_val_steps=-1, min_steps=3, max_time="00:01:30:00", deterministic="warn",
                enable_progress_bar=False, logger=False)
    assert t.accumulate_grad_batches == 4 and t.gradient_clip_val == 0.5
    assert t.limits["train"] == 0.25 and t.limits["val"] == 3 and t.max_time == timedelta(hours=1, minutes=30)
    fast = Trainer(fast_dev_run=True, callbacks=[ModelCheckpoint()], logger="csv")
    assert fast.max_steps == 1 and fast.limits["train"] == 1 and fast.limits["val"] == 1
    assert fast.checkpoint_callback is None and fast.logging.spec is False


def test_limits_and_max_time():
    assert limited_batches(10, None) == 10 and limited_batches(10, 3) == 3 and limited_batches(2, 5) == 2
    assert limited_batches(10, 0.25) == 2 and limited_batches(10, 0.01) == 1 and limited_batches(10, 0.0) == 0
    with pytest.raises(ValueError, match="fractional batch limit .* give an int"):
        limited_batches(None, 0.5)
    assert parse_max_time({"minutes": 2}) == timedelta(minutes=2)
    assert parse_max_time("01:00:00:05") == timedelta(days=1, seconds=5)


def test_lightning_callbacks_are_rejected_naming_ours():
    from lightning.pytorch.callbacks import EarlyStopping as LEarlyStopping
    from lightning.pytorch.callbacks import LearningRateMonitor, RichProgressBar, Timer

    for cb, ours in [(LEarlyStopping(monitor="val/loss"), "EarlyStopping"), (Timer(), "Timer"),
                     (LearningRateMonitor(), "LearningRateMonitor"), (RichProgressBar(), "ProgressBar")]:
        with pytest.raises(TypeError, match=f"is a Lightning callback.*use verl_trainer.callbacks.{ours}"):
            Trainer(callbacks=[cb])
    with pytest.raises(TypeError, match="Callback instances, got int"):
        Trainer(callbacks=[3])


def test_hooks_that_are_never_called_are_found():
    class Typos(Callback):
        def on_train_epoch_begin(self, trainer, module):  # Lightning 1.x name, never called
            pass

        def on_validation_model_eval(self):  # a LightningModule hook
            pass

        def on_train_epoch_end(self, trainer, module):  # a real hook
            pass

    assert unknown_hooks(Typos()) == ["on_train_epoch_begin", "on_validation_model_eval"]
    assert unknown_hooks(EarlyStopping(monitor="x")) == []


def test_early_stopping_decisions():
    es = EarlyStopping(monitor="val/loss", patience=2, min_delta=0.1)
    assert [es._evaluate(v) is not None for v in (1.0, 0.95, 0.5, 0.45, 0.44)] == [False, False, False, False,
                                                                                  True]
    assert es.best_score == 0.5
    assert EarlyStopping(monitor="m", mode="max", stopping_threshold=0.9)._evaluate(0.95) is not None
    assert EarlyStopping(monitor="m", divergence_threshold=5.0)._evaluate(6.0) is not None
    assert EarlyStopping(monitor="m")._evaluate(float("nan")) is not None
    with pytest.raises(ValueError, match="mode='avg'"):
        EarlyStopping(monitor="m", mode="avg")


def test_tensorboard_logger_names_the_package():
    import importlib.util

    if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX"):
        pytest.skip("tensorboard is installed here")
    with pytest.raises(ValueError, match="needs the tensorboard package.*pip install tensorboard"):
        Trainer(logger="tensorboard")


def test_mlflow_logger_names_the_extra():
    """logger='mlflow' without mlflow installed: the error names the extra (test_logger_extras.py
    runs a fit with it where it is installed)."""
    import importlib.util

    if importlib.util.find_spec("mlflow"):
        pytest.skip("mlflow is installed here")
    with pytest.raises(ValueError, match=r"needs the mlflow package.*pip install verl-trainer\[mlflow\]"):
        Trainer(logger=["csv", "mlflow"])
