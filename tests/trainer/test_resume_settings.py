"""A resume is checked against the settings its checkpoint recorded (``training/resume_check.py``).

One 1-rank process (fsdp2, CPU) writes a 2-step SFT checkpoint, then resumes it with:

* another strategy (deepspeed), another seed, another model, another optimizer class (``optim.optimizer``):
  clear errors naming both values, raised before any engine is built;
* another learning rate and ``max_steps``: the resume runs, lists both changes, and the new learning
  rate is the optimizer's (the checkpoint had restored the old one before).

An unchanged resume stays bitwise: ``tests/trainer/test_resume.py`` (the same restore path).

``slow``: the 1-rank fsdp2 checkpoint resumed at 2 ranks (DCP reshards it) finishes and logs the change.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.common import SFTData, sft_module, tiny_model
from verl_trainer.testing.ranks import run_distributed


def _trainer(root: Path, strategy: str = "fsdp2", max_steps: int = 2, seed: int = 3, devices: int = 1):
    from verl_trainer import Trainer
    from verl_trainer.callbacks import ModelCheckpoint

    return Trainer(strategy=strategy, devices=devices, max_steps=max_steps, default_root_dir=root,
                   logger=False, enable_progress_bar=False, seed=seed,
                   callbacks=[ModelCheckpoint(every_n_train_steps=1, keep_last_k=1)])


def _refused(make_trainer, module, ckpt: str) -> tuple[str, bool]:
    from verl_trainer.training.resume_check import ResumeMismatchError

    try:
        make_trainer().fit(module, SFTData(n=32, batch_size=4), ckpt_path=ckpt)
    except ResumeMismatchError as exc:
        return str(exc), bool(module.engines)
    return "", bool(module.engines)


def _resumes(model: str, other_model: str, root: str) -> dict:
    import importlib.util

    root_p = Path(root)
    out: dict = {}
    _trainer(root_p / "a").fit(sft_module(model), SFTData(n=32, batch_size=4))
    ckpt = str(root_p / "a" / "checkpoints" / "step_000002")
    if importlib.util.find_spec("deepspeed") is not None:
        deepspeed = _refused(lambda: _trainer(root_p / "a", strategy="deepspeed"), sft_module(model), ckpt)
        out["strategy"] = deepspeed
    out["seed"] = _refused(lambda: _trainer(root_p / "a", seed=4), sft_module(model), ckpt)
    out["model"] = _refused(lambda: _trainer(root_p / "a", max_steps=3), sft_module(other_model), ckpt)
    sgd = sft_module(model, optimizer="sgd")
    out["optimizer"] = _refused(lambda: _trainer(root_p / "a", max_steps=3), sgd, ckpt)

    changed = sft_module(model, lr=5e-4)
    trainer = _trainer(root_p / "a", max_steps=3)
    trainer.fit(changed, SFTData(n=32, batch_size=4), ckpt_path="last")
    out["changes"] = trainer.resume_changes
    out["lr"] = changed.engines["actor"].optimizer.param_groups[0]["lr"]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("resume_settings")
    model = tiny_model(base / "model")
    from verl_trainer.models.tiny import make_tiny_model

    other = make_tiny_model(base / "other", arch="llama", hidden_size=48, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, seed=1)
    return run_distributed(_resumes, 1, model, other, str(base / "runs"), timeout=400)[0]


def test_other_strategy_is_refused_before_any_engine_is_built(results):
    if "strategy" not in results:
        pytest.skip("deepspeed is not installed")
    message, built = results["strategy"]
    assert "strategy is 'deepspeed' in this run but 'fsdp2' in the checkpoint" in message, message
    assert not built


def test_other_seed_is_refused(results):
    message, built = results["seed"]
    assert "seed is 4 in this run but 3 in the checkpoint" in message and "data order" in message, message
    assert not built


def test_other_model_is_refused_naming_the_difference(results):
    message, _ = results["model"]
    assert "engine 'actor' has another model" in message, message
    assert "hidden_size: 32 in the checkpoint, 48 now" in message, message


def test_other_optimizer_class_is_refused(results):
    message, built = results["optimizer"]
    assert "config optim.optimizer is 'sgd' in this run but 'adamw' in the checkpoint" in message, message
    assert "the other optimizer's state" in message and not built


def test_new_learning_rate_applies_and_is_listed(results):
    changes = results["changes"]
    assert changes == ["trainer.max_steps: 2 -> 3", "config optim.lr: 0.001 -> 0.0005"], changes
    assert results["lr"] == 5e-4


def _reshard(model: str, root: str) -> dict:
    import torch.distributed as dist

    module = sft_module(model)
    trainer = _trainer(Path(root), max_steps=3, devices=dist.get_world_size())
    trainer.fit(module, SFTData(n=32, batch_size=4), ckpt_path="last")
    return {"changes": trainer.resume_changes, "step": trainer.global_step}


@pytest.mark.slow
def test_fsdp2_checkpoint_resumes_at_another_world_size(tmp_path):
    model = tiny_model(tmp_path / "model")
    run_distributed(_first_fit, 1, model, str(tmp_path / "run"), timeout=300)
    got = run_distributed(_reshard, 2, model, str(tmp_path / "run"), timeout=400)
    assert got[0]["step"] == 3
    assert "world size: 1 -> 2 (DCP reshards the state)" in got[0]["changes"]


def _first_fit(model: str, root: str) -> None:
    _trainer(Path(root)).fit(sft_module(model), SFTData(n=32, batch_size=4))
