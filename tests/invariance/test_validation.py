"""Validation metrics do not depend on the device count: 5 validation prompts on 1, 2 and 4 ranks.

With 5 rows on 2 ranks the sampler repeats one row to give both ranks 3; that row is a padding sample
and must count in no metric. The reward here is the prompt's ground truth (the sum ``a+b``), so every
prompt scores differently and a row counted twice moves ``val/reward/mean``; the expected value is the
mean over the file, computed here without the trainer. Default run: 2 ranks, GRPO. ``invariance_full``:
4 ranks, and the SFT validation loss at 2 ranks equal to 1 rank's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.trainer.common import tiny_model
from verl_trainer.data.tasks import ArithmeticTaskConfig, write_arithmetic_task
from verl_trainer.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
NUM_VAL = 5


def truth_score(data_source: str, solution_str: str, ground_truth: str,
                extra_info: dict | None = None) -> dict:
    """The ground truth as the reward (and ``acc`` = whether it is even): a value per prompt."""
    value = float(ground_truth)
    return {"score": value, "acc": float(value % 2 == 0)}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("val_invariance")
    tiny_model(base / "model")
    task = ArithmeticTaskConfig(num_train=16, num_val=NUM_VAL, holdout_fraction=0.3)
    write_arithmetic_task(base / "data", task)
    return base


def _truths(path: Path) -> list[float]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [float(r["reward_model"]["ground_truth"]) for r in rows]


def _grpo_validate(model: str, data: str, root: str) -> dict[str, float]:
    from verl_trainer import Trainer
    from verl_trainer.algorithms import GRPO, PromptDataModule
    from verl_trainer.models.loading import load_tokenizer
    from verl_trainer.recipe_config import GRPORecipeConfig, load_config

    cfg = load_config(GRPORecipeConfig, ROOT / "configs" / "grpo.yaml", [
        f"algorithm.model_path={model}", f"data.train_files={data}/train.jsonl",
        f"data.val_files={data}/val.jsonl", "algorithm.rollout.max_new_tokens=3",
        "algorithm.reward.name=tests.invariance.test_validation:truth_score",
    ])
    trainer = Trainer(devices=dist.get_world_size(), logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, default_root_dir=root)
    module = GRPO(cfg.algorithm)
    return trainer.validate(module, datamodule=PromptDataModule(cfg.data, load_tokenizer(model)))[0]


def _check_grpo(results: list[dict[str, float]], truths: list[float]) -> None:
    assert len(truths) == NUM_VAL
    for metrics in results:
        assert metrics == results[0], "every rank logs the same reduced values"
    got = results[0]
    assert got["val/reward/mean"] == pytest.approx(sum(truths) / NUM_VAL, rel=1e-6)
    assert got["val/reward/min"] == min(truths) and got["val/reward/max"] == max(truths)
    assert got["val/reward/accuracy"] == pytest.approx(sum(t % 2 == 0 for t in truths) / NUM_VAL, rel=1e-6)


@pytest.mark.invariance
def test_grpo_validation_at_2_ranks_counts_each_prompt_once(assets, tmp_path):
    results = run_distributed(_grpo_validate, 2, str(assets / "model"), str(assets / "data"), str(tmp_path),
                              timeout=300)
    _check_grpo(results, _truths(assets / "data" / "val.jsonl"))


@pytest.mark.invariance
@pytest.mark.invariance_full
def test_grpo_validation_at_4_ranks_counts_each_prompt_once(assets, tmp_path):
    results = run_distributed(_grpo_validate, 4, str(assets / "model"), str(assets / "data"), str(tmp_path),
                              timeout=400)
    _check_grpo(results, _truths(assets / "data" / "val.jsonl"))


def _sft_validate(model: str, root: str) -> dict[str, float]:
    from tests.trainer.common import SFTData, sft_module
    from verl_trainer import Trainer

    trainer = Trainer(devices=dist.get_world_size(), logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, default_root_dir=root)
    return trainer.validate(sft_module(model), SFTData(n=8, batch_size=NUM_VAL, val=NUM_VAL))[0]


@pytest.mark.invariance
@pytest.mark.invariance_full
def test_sft_validation_loss_at_2_ranks_equals_1_rank(assets, tmp_path):
    one = run_distributed(_sft_validate, 1, str(assets / "model"), str(tmp_path / "one"), timeout=300)[0]
    two = run_distributed(_sft_validate, 2, str(assets / "model"), str(tmp_path / "two"), timeout=300)
    assert two[0] == two[1]
    assert two[0]["val/loss"] == pytest.approx(one["val/loss"], rel=1e-5, abs=1e-6)
