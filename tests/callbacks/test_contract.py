"""The Trainer and TrainingModule have every member the callbacks' protocols name."""

import inspect

from verl_trainer import Trainer
from verl_trainer.callbacks import CallbackModule, CallbackTrainer
from verl_trainer.module import TrainingModule


def _members(protocol: type) -> set[str]:
    declared = set(getattr(protocol, "__annotations__", {}))
    defined = {name for name, _ in inspect.getmembers(protocol) if not name.startswith("_")}
    return declared | defined


def test_the_trainer_has_what_callbacks_use():
    trainer = Trainer(accelerator="cpu", max_steps=1, logger=False)
    assert [name for name in sorted(_members(CallbackTrainer)) if not hasattr(trainer, name)] == []


def test_a_module_has_what_callbacks_use():
    declared = set(vars(TrainingModule)) | {"engines"}  # engines: set in __init__
    assert sorted(_members(CallbackModule) - declared) == []
