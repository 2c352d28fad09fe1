"""Validation generations (verl's ``trainer.log_val_generations``): a real validation of a tiny model
prints the first samples, writes them as JSONL under the run directory and logs them as a wandb table
(offline); training steps' (TRL's ``log_completions``: ``algorithm.log_train_generations``) likewise."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from verl_trainer import Trainer
from verl_trainer.algorithms import GRPO, PromptDataModule
from verl_trainer.data.prompts import save_rows, to_verl_row
from verl_trainer.models import make_tiny_model
from verl_trainer.models.loading import load_tokenizer
from verl_trainer.recipe_config import GRPORecipeConfig, load_config
from verl_trainer.recipe_config.verl_keys import translate_overrides
from verl_trainer.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]


def _validate(model: str, data: str, root: str) -> str:
    """One validation with verl's ``trainer.log_val_generations=3`` and wandb on; returns the console."""
    overrides, _ = translate_overrides(GRPORecipeConfig, [
        f"algorithm.model_path={model}", f"data.train_files={data}/train.jsonl",
        f"data.val_files={data}/val.jsonl", "data.val_batch_size=2", "algorithm.rollout.max_new_tokens=4",
        "trainer.log_val_generations=3"])  # verl's key: algorithm.val_rollout.log_generations
    cfg = load_config(GRPORecipeConfig, ROOT / "configs" / "grpo.yaml", overrides)
    assert cfg.algorithm.val_rollout.log_generations == 3
    trainer = Trainer(devices=1, logger=["wandb"], enable_checkpointing=False, enable_progress_bar=False,
                      default_root_dir=root)
    console = io.StringIO()
    with contextlib.redirect_stdout(console):
        trainer.validate(GRPO(cfg.algorithm), datamodule=PromptDataModule(cfg.data, load_tokenizer(model)))
    return console.getvalue()


def test_validation_generations_are_printed_written_as_jsonl_and_a_wandb_table(tmp_path):
    model = make_tiny_model(tmp_path / "model", hidden_size=16, num_attention_heads=2, num_key_value_heads=1)
    rows = [to_verl_row(f"{i}+1=", str(i + 1), "arith") for i in range(5)]
    save_rows(rows, tmp_path / "train.jsonl")
    save_rows(rows, tmp_path / "val.jsonl")
    root = tmp_path / "run"
    [out] = run_distributed(_validate, 1, str(model), str(tmp_path), str(root), env={"WANDB_MODE": "offline"})
    jsonl = root / "generations" / "val_step_0.jsonl"
    written = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["prompt"] for r in written] == ["0+1=", "1+1=", "2+1="]  # 3 of 5, over two val batches
    assert [r["ground_truth"] for r in written] == ["1", "2", "3"]
    assert all(isinstance(r["response"], str) and isinstance(r["score"], float) for r in written)
    assert "[validation generations, step 0]" in out
    assert all(f"--- response:\n{r['response']}\n" in out for r in written)
    tables = list((root / "wandb").glob("offline-run-*/files/media/table/val/generations_*.table.json"))
    assert tables, sorted(str(p) for p in (root / "wandb").rglob("*"))[:40]
    table = json.loads(max(tables, key=lambda p: p.stat().st_mtime).read_text())
    assert table["columns"] == ["step", "data_source", "prompt", "response", "score", "ground_truth"]
    assert [row[2] for row in table["data"]] == ["0+1=", "1+1=", "2+1="]


def _fit_one_step(model: str, data: str, root: str) -> str:
    """One GRPO step with TRL's habit ``log_completions``: ``algorithm.log_train_generations=2``."""
    cfg = load_config(GRPORecipeConfig, ROOT / "configs" / "grpo.yaml", [
        f"algorithm.model_path={model}", f"data.train_files={data}/train.jsonl", "data.val_files=null",
        "data.train_batch_size=4", "algorithm.rollout.n=2", "algorithm.rollout.max_new_tokens=4",
        "algorithm.actor.ppo_mini_batch_size=4", "algorithm.log_train_generations=2"])
    trainer = Trainer(devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, default_root_dir=root)
    console = io.StringIO()
    with contextlib.redirect_stdout(console):
        trainer.fit(GRPO(cfg.algorithm), datamodule=PromptDataModule(cfg.data, load_tokenizer(model)))
    return console.getvalue()


def test_training_generations_of_each_step_are_printed_and_written(tmp_path):
    model = make_tiny_model(tmp_path / "model", hidden_size=16, num_attention_heads=2, num_key_value_heads=1)
    save_rows([to_verl_row(f"{i}+1=", str(i + 1), "arith") for i in range(4)], tmp_path / "train.jsonl")
    root = tmp_path / "run"
    [out] = run_distributed(_fit_one_step, 1, str(model), str(tmp_path), str(root))
    jsonl = root / "generations" / "train_step_1.jsonl"
    written = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(written) == 2 and all(r["step"] == 1 for r in written)
    assert "[training generations, step 1]" in out
    assert all(f"--- response:\n{r['response']}\n" in out for r in written)


def test_log_generations_must_be_a_count():
    from verl_trainer.algorithms import GRPOConfig
    from verl_trainer.algorithms.config import ValidationRolloutConfig

    for value in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r"val_rollout.log_generations=.* must be an int >= 0"):
            ValidationRolloutConfig(log_generations=value)
        with pytest.raises(ValueError, match=r"algorithm.log_train_generations=.* must be an int >= 0"):
            GRPOConfig(log_train_generations=value)
