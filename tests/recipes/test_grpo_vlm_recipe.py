"""recipes/grpo_vlm.py: the configs load; (slow) SFT warm start then GRPO on the colour task with a tiny
Qwen2.5-VL raises the greedy validation reward, and the exported model evaluates with its images."""

from __future__ import annotations

import csv
import json
import runpy
import sys
from pathlib import Path

import pytest

from verl_trainer.algorithms.config import GRPOConfig
from verl_trainer.algorithms.sft import SFTConfig
from verl_trainer.recipe_config import GRPORecipeConfig, SFTRecipeConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "grpo_vlm.py"


def test_the_vlm_configs_load_into_their_schemas():
    grpo = load_config(GRPORecipeConfig, ROOT / "configs" / "grpo_vlm.yaml")
    assert isinstance(grpo.algorithm, GRPOConfig) and grpo.algorithm.rollout.name == "hf"
    assert grpo.algorithm.reward.name == "shape_colour" and grpo.warm_start.enable is True
    sft = load_config(SFTRecipeConfig, ROOT / "configs" / "sft_vlm.yaml")
    assert isinstance(sft.algorithm, SFTConfig) and sft.model.path == grpo.model.path


def _val_rewards(root: Path) -> list[float]:
    (path,) = root.rglob("metrics.csv")
    with open(path) as f:
        return [float(r["val/reward/mean"]) for r in csv.DictReader(f) if r.get("val/reward/mean")]


@pytest.mark.slow
def test_sft_then_grpo_raises_the_greedy_reward_and_the_export_evaluates(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["trainer.max_steps=12", "trainer.val_check_interval=12", "warm_start.max_steps=30",
            "data.val_files=outputs/data/shape_colour/val.parquet"]
    monkeypatch.setattr(sys, "argv", [str(RECIPE), *argv])
    runpy.run_path(str(RECIPE), run_name="recipe")["main"](argv=argv)
    rewards = _val_rewards(Path("outputs/grpo_vlm"))
    assert len(rewards) >= 2 and rewards[-1] > rewards[0] + 0.1, rewards

    from verl_trainer.evaluate.__main__ import main as evaluate

    out = tmp_path / "eval.json"
    assert evaluate(["outputs/grpo_vlm/hf", "data.val_files=outputs/data/shape_colour/val.parquet",
                     "reward.name=shape_colour", f"eval.output={out}", "eval.n=1",
                     "eval.rollout.do_sample=false", "eval.rollout.max_new_tokens=8",
                     "eval.logger=null"]) == 0
    report = json.loads(out.read_text())
    assert abs(report["metrics"]["mean@1"] - rewards[-1]) < 1e-6, (report["metrics"], rewards)
