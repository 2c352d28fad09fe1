"""Bad settings fail before any model loads, with a message that names the setting (issue 13 item 5,
issue 18 item 8). The recipes run in this process (``runpy``), except the 2-device case, which checks that
the error is printed once by the launching process."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from tests.recipes.test_recipes import make_recipe_assets

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return make_recipe_assets(tmp_path_factory.mktemp("early_assets"))


def _args(assets: Path, root: Path, *overrides: str) -> list[str]:
    return [
        "trainer.max_steps=1", "trainer.logger=[csv]", f"trainer.default_root_dir={root}",
        f"model.path={assets / 'model'}", "model.make_tiny_if_missing=false", f"task.dir={assets / 'data'}",
        "task.write_if_missing=false", "data.train_batch_size=4", *overrides,
    ]


def run_in_process(recipe: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The recipe's ``main`` on ``argv`` in this process; its errors propagate (the command line would print
    a user error's message alone: ``tests/recipes/test_user_errors.py``)."""
    monkeypatch.setattr(sys, "argv", [str(RECIPES / f"{recipe}.py"), *argv])
    runpy.run_path(str(RECIPES / f"{recipe}.py"), run_name="recipe")["main"](argv=argv)


def _no_model_loaded(capfd: pytest.CaptureFixture[str]) -> None:
    out, err = capfd.readouterr()
    assert "Loading weights" not in out + err, "a model was loaded before the error"


@pytest.mark.parametrize(
    ("recipe", "overrides", "error", "match"),
    [
        ("grpo", ["data.train_files=/nonexistent/train.jsonl"], FileNotFoundError,
         r"data.train_files='/nonexistent/train.jsonl' does not exist"),
        ("grpo", ["data.max_prompt_length=2"], ValueError,
         r"train.jsonl: prompt row 0 has \d+ tokens > max_prompt_length=2; .*data.truncation"),
        ("grpo", ["trainer.devices=4", "data.train_batch_size=6"], ValueError,
         r"data.train_batch_size=6 is not divisible by the data-parallel size 4"),
        ("grpo", ["algorithm.actor.ppo_mini_batch_size=3"], ValueError,
         r"algorithm.actor.ppo_mini_batch_size=3 does not divide data.train_batch_size=4 \(both in prompts "
         r"per step\).*a divisor of 4 \(1, 2, 4; null: the whole batch\), or data.train_batch_size to a "
         r"multiple of 3"),
        ("grpo", ["trainer.devices=3", "algorithm.rollout.placement=separate",
                  "algorithm.rollout.rollout_ranks=2"], ValueError,
         r"the 1 trainer ranks .* must be a multiple of rollout_ranks=2"),
        ("grpo", ["trainer.devices=4", "algorithm.rollout.placement=separate"], ValueError,
         r"data.train_batch_size=4 is not divisible by the data-parallel size 3"),  # 4 - 1 rollout rank
        ("ppo", ["trainer.logger=[nope]"], ValueError, r"nope"),
        ("sft", ["data.train_files=${task.dir}/train.jsonl"], ValueError,
         r"train.jsonl: SFT row 0: a prompt-only row has nothing to train on \(it is RL data\)"),
    ],
    ids=["missing-file", "long-prompt", "batch-vs-devices", "mini-batch-vs-batch", "pool-vs-devices",
         "batch-vs-trainer-ranks", "logger", "sft-columns"],
)
def test_recipe_errors_before_any_model_loads(assets, tmp_path, monkeypatch, capfd, recipe, overrides, error,
                                              match):
    if recipe != "sft":
        overrides.append("warm_start.enable=false")
    with pytest.raises(error, match=match):
        run_in_process(recipe, _args(assets, tmp_path, *overrides), monkeypatch)
    _no_model_loaded(capfd)


def test_settings_of_the_other_rollout_backend_are_named_as_not_read(assets, tmp_path, monkeypatch, capfd):
    """verl scripts set vLLM's keys; the HF rollout says it does not read them (before any model loads)."""
    overrides = ["warm_start.enable=false", "algorithm.rollout.name=hf", "data.train_files=/nope.jsonl",
                 "actor_rollout_ref.rollout.gpu_memory_utilization=0.7",
                 "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                 "algorithm.rollout.enforce_eager=false"]
    with pytest.raises(FileNotFoundError):  # stops the run right after the note, before a model loads
        run_in_process("grpo", _args(assets, tmp_path, *overrides), monkeypatch)
    out, _ = capfd.readouterr()
    assert out.count("note: the hf rollout does not read") == 1, out  # once, at start-up
    assert ("note: the hf rollout does not read algorithm.rollout.gpu_memory_utilization=0.7, "
            "algorithm.rollout.tensor_parallel_size=2, algorithm.rollout.enforce_eager=False (settings of "
            "the other backend") in out, out
    from verl_trainer.rollout.config import RolloutConfig

    assert RolloutConfig(name="vllm", decoding="generate").ignored_by("vllm") == ["decoding=generate"]
    assert RolloutConfig(max_model_len=64).ignored_by("vllm") == []


def test_truncation_and_filtering_keys(assets, tmp_path, monkeypatch):
    from verl_trainer.algorithms.data import DataConfig

    with pytest.raises(ValueError, match="data.truncation='cut'; choose one of error, left, right, middle"):
        DataConfig(truncation="cut")
    cfg = DataConfig(train_files=str(assets / "data" / "train.jsonl"), max_prompt_length=3, truncation="left")
    from verl_trainer.algorithms.data import PromptDataModule
    from verl_trainer.models.loading import load_tokenizer

    data = PromptDataModule(cfg, load_tokenizer(str(assets / "model")))
    data.check(dp_size=2)
    assert max(len(item["input_ids"]) for item in data._train) == 3


def test_wrong_reward_signature_and_dr_grpo_fail_before_the_warm_start(assets, tmp_path, monkeypatch, capfd):
    reward = tmp_path / "my_reward.py"
    reward.write_text("def score(text):\n    return 0.0\n")
    warm_out = tmp_path / "warm"
    common = _args(assets, tmp_path, "warm_start.enable=true", f"warm_start.output={warm_out}",
                   "warm_start.train_files=${task.dir}/sft_train.jsonl")
    with pytest.raises(ValueError, match=r"my_reward.py:score has the signature \(text\), which is neither"):
        run_in_process("grpo", [*common, f"algorithm.reward.name={reward}:score"], monkeypatch)
    with pytest.raises(ValueError, match="Dr.GRPO needs algorithm.norm_adv_by_std_in_grpo=false"):
        run_in_process("dr_grpo", [*common, "algorithm.norm_adv_by_std_in_grpo=true"], monkeypatch)
    with pytest.raises(FileNotFoundError, match="warm_start: data.train_files='.*missing_sft.jsonl' does not "
                       "exist.*warm_start.train_files"):
        run_in_process("grpo", [*common, f"warm_start.train_files={tmp_path / 'missing_sft.jsonl'}"],
                       monkeypatch)
    assert not warm_out.exists()
    _no_model_loaded(capfd)


@pytest.mark.slow
def test_a_config_error_at_two_devices_is_printed_once(assets, tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    args = _args(assets, tmp_path, "trainer.devices=2", "data.train_batch_size=3", "warm_start.enable=false")
    proc = subprocess.run([sys.executable, str(RECIPES / "grpo.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count("data.train_batch_size=3 is not divisible by the data-parallel size 2") == 1, out
    assert "RankFailedError" not in out and "frame #" not in out and "Loading weights" not in out, out


def test_unknown_data_source_for_default_compute_score_fails_before_any_model_loads(assets, tmp_path,
                                                                                      monkeypatch, capfd):
    from verl_trainer.data.prompts import save_rows, to_verl_row

    save_rows([to_verl_row("1+1=", "2", "my_task")] * 4, tmp_path / "val.jsonl")
    overrides = ["warm_start.enable=false", "algorithm.reward.name=default_compute_score",
                 f"data.val_files={tmp_path / 'val.jsonl'}"]
    with pytest.raises(ValueError, match=r"no scorer for the data source\(s\) \['my_task'\]; it knows"):
        run_in_process("grpo", _args(assets, tmp_path, *overrides), monkeypatch)
    _no_model_loaded(capfd)
