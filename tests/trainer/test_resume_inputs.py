"""A resume is checked against the inputs its checkpoint recorded: LoRA base weights and data files.

One 1-rank process (fsdp2, CPU, LoRA SFT on two real jsonl files) writes a 2-step checkpoint, then:

* resuming with another ``data.train_files`` (other content) is refused naming both paths, before any
  engine is built (it used to continue silently at the old data position);
* the same content at another path, and other validation data, resume and are listed;
* base weights rewritten at ``model_path`` (same architecture, other values) are refused naming the
  engine and the file (the adapters were trained on the old ones; only the architecture was compared).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.trainer.common import tiny_model
from verl_trainer.testing.ranks import run_distributed


def _write(path: Path, n: int, offset: int = 0) -> str:
    rows = [{"prompt": f"{i + offset}+1=", "response": str(i + offset + 1)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _fit(root: Path, model: str, train: str, val: str | None, max_steps: int, ckpt: str | None = None):
    from verl_trainer import Trainer
    from verl_trainer.algorithms.data import DataConfig, SFTDataModule
    from verl_trainer.algorithms.sft import SFT, SFTConfig
    from verl_trainer.callbacks import ModelCheckpoint
    from verl_trainer.engine import EngineConfig, OptimConfig
    from verl_trainer.models.loading import load_tokenizer

    module = SFT(SFTConfig(model_path=model, engine=EngineConfig(micro_batch_size_per_gpu=2, lora_rank=2),
                           optim=OptimConfig(lr=1e-3, weight_decay=0.0)))
    data = SFTDataModule(DataConfig(train_files=train, val_files=val, train_batch_size=4, val_batch_size=4),
                         load_tokenizer(model))
    trainer = Trainer(strategy="fsdp2", devices=1, max_steps=max_steps, default_root_dir=root, logger=False,
                      enable_progress_bar=False, seed=3, val_check_interval=None,
                      callbacks=[ModelCheckpoint(every_n_train_steps=1, keep_last_k=1)])
    trainer.fit(module, data, ckpt_path=ckpt)
    return trainer, module


def _runs(model: str, root: str) -> dict:
    from verl_trainer.models.tiny import make_tiny_model
    from verl_trainer.training.resume_check import ResumeMismatchError

    base = Path(root)
    train, val = _write(base / "train.jsonl", 16), _write(base / "val.jsonl", 4, offset=50)
    other = _write(base / "other.jsonl", 16, offset=20)
    _fit(base / "run", model, train, val, 2)
    ckpt = str(base / "run" / "checkpoints" / "step_000002")
    out: dict = {"meta": json.loads((Path(ckpt) / "meta.json").read_text())}
    try:
        _fit(base / "run", model, other, val, 3, ckpt)
    except ResumeMismatchError as exc:
        out["other_data"] = str(exc)
    copy = shutil.copy(train, base / "copy.jsonl")
    trainer, _ = _fit(base / "run", model, str(copy), _write(base / "val2.jsonl", 4), 3, "last")
    out["same_content_changes"], out["resumed_step"] = trainer.resume_changes, trainer.global_step
    make_tiny_model(model, arch="llama", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, seed=2)  # the same architecture, other weights, same path
    try:
        _fit(base / "run", model, str(copy), val, 4, "last")
    except ResumeMismatchError as exc:
        out["other_base"] = str(exc)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("resume_inputs")
    model = tiny_model(base / "model")
    return run_distributed(_runs, 1, model, str(base), timeout=400, env={"WANDB_MODE": "offline"})[0]


def test_the_checkpoint_records_the_base_weights_and_the_data(results):
    meta = results["meta"]
    assert set(meta["base_weights"]["actor"]["files"]) == {"model.safetensors"}
    assert meta["data"]["train_files"]["content"].startswith("sha256:")


def test_other_training_data_is_refused_naming_both_files(results):
    message = results["other_data"]
    assert "the training data changed since the checkpoint" in message
    assert "train.jsonl' then" in message and "other.jsonl' now" in message
    assert "start a new run" in message


def test_the_same_data_elsewhere_and_new_validation_data_resume_and_are_listed(results):
    assert results["resumed_step"] == 3
    changes = "\n".join(results["same_content_changes"])
    assert "data.train_files:" in changes and "copy.jsonl' (the same content)" in changes
    assert "data.val_files:" in changes and "val2.jsonl' (other content)" in changes


def test_changed_lora_base_weights_are_refused_naming_the_engine_and_file(results):
    message = results["other_base"]
    assert "the base weights of LoRA engine 'actor' changed since the checkpoint" in message
    assert "model.safetensors: sha256:" in message and "Put the original base model back" in message
