"""recipes/dpo.py: its config, its errors before any model loads, and (slow) the demo's preference metrics
rising on the arithmetic pairs."""

from __future__ import annotations

import csv
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from verl_trainer.recipe_config import DPORecipeConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "dpo.py"
CONFIG = ROOT / "configs" / "dpo.yaml"


def _run(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [str(RECIPE), *argv])
    runpy.run_path(str(RECIPE), run_name="recipe")["main"](argv=argv)


def test_config_loads_with_every_loss_type():
    for loss in ("sigmoid", "ipo", "robust", "simpo", "orpo", "kto"):
        cfg = load_config(DPORecipeConfig, CONFIG, [f"algorithm.loss.loss_type={loss}"])
        assert cfg.algorithm.loss.loss_type == loss
        assert cfg.algorithm.loss.needs_reference == (loss not in ("simpo", "orpo"))


@pytest.mark.parametrize(("overrides", "match"), [
    (["algorithm.loss.loss_type=dpo"], r"algorithm.loss.loss_type='dpo'; choose one of sigmoid, ipo"),
    (["algorithm.loss.loss_type=ipo", "algorithm.loss.label_smoothing=0.1"], "has no effect with"),
    (["algorithm.ref.in_actor=true"], "algorithm.ref.in_actor=true makes the reference the actor"),
])
def test_bad_settings_fail_when_the_config_is_built(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(DPORecipeConfig, CONFIG, overrides)


def test_pair_columns_are_checked_before_any_model_loads(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)  # the demo's tiny model is made here
    rows = tmp_path / "bad.jsonl"
    rows.write_text('{"prompt": "1+1=", "chosen": "2"}\n' * 8)
    with pytest.raises(ValueError, match=r"bad.jsonl: row 0: a preference row needs 'prompt', 'chosen'"):
        _run([f"data.train_files={rows}", "data.val_files=null", "data.train_batch_size=4",
              "trainer.logger=[csv]"], monkeypatch)
    out, err = capfd.readouterr()
    assert "Loading weights" not in out + err


def _val(csv_path: Path, key: str) -> list[float]:
    with csv_path.open() as f:
        return [float(r[key]) for r in csv.DictReader(f) if r.get(key)]


def _subprocess(cwd: Path, *overrides: str) -> Path:
    """The recipe as a command in ``cwd`` (the demo's model and task are made there); its metrics CSV."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(RECIPE), "trainer.logger=[csv]", "trainer.export_hf=false",
                           *overrides], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"dpo failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    (csv_path,) = cwd.rglob("metrics.csv")
    return csv_path


@pytest.mark.slow  # ~30 s on one process
def test_dpo_demo_raises_held_out_preference_accuracy_and_margin(tmp_path):
    """The demo as shipped (150 steps, one process): measured 0.00 -> 0.85 accuracy, 0 -> 0.74 margin."""
    csv_path = _subprocess(tmp_path, "trainer.val_check_interval=150")
    accuracy, margin = _val(csv_path, "val/rewards/accuracies"), _val(csv_path, "val/rewards/margins")
    assert accuracy[0] == 0.0 and margin[0] == 0.0  # the policy is its reference before the first step
    assert accuracy[-1] >= 0.7 and margin[-1] > 0.3
    assert _val(csv_path, "val/loss")[-1] < 0.6


@pytest.mark.slow  # ~60 s: two ranks
def test_kto_runs_on_two_ranks_with_balancing(tmp_path):
    """KTO at dp=2: pairs unpaired into examples, their KL rows balanced with them, one z0 for the step."""
    csv_path = _subprocess(tmp_path, "algorithm.loss.loss_type=kto", "trainer.devices=2",
                           "trainer.max_steps=3", "trainer.val_check_interval=null",
                           "data.train_batch_size=8")
    kl = _val(csv_path, "kto/kl")
    assert len(kl) == 3 and kl[0] == 0.0 and all(k >= 0.0 for k in kl)  # z0: clamped mean log-ratio
    assert len(_val(csv_path, "rewards/chosen")) == 3 and len(_val(csv_path, "global_seqlen/max")) == 3
