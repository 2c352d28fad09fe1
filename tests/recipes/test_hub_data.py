"""``python recipes/sft.py data.train_files=<org/name>``: a hub dataset id in the local HF cache trains
(issue 29 item 4), in a real process with a temporary ``HF_HOME`` in the hub cache's layout and
``HF_HUB_OFFLINE=1``; one that is not there fails in the recipe's checks, before any model loads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.common import read_csv_metrics
from verl_trainer.models.tiny import make_tiny_model
from verl_trainer.testing.hub_cache import parquet_bytes, write_cached_dataset

ROOT = Path(__file__).resolve().parents[2]


def _args(tmp_path: Path, *overrides: str, devices: int = 1) -> list[str]:
    model = make_tiny_model(tmp_path / "model", hidden_size=16, num_attention_heads=2, num_key_value_heads=1)
    return [f"trainer.devices={devices}", "trainer.max_steps=2", "trainer.val_check_interval=null",
            "trainer.logger=[csv]", f"trainer.default_root_dir={tmp_path}/run", f"model.path={model}",
            f"task.dir={tmp_path}/task", "data.train_batch_size=4",
            "algorithm.engine.micro_batch_size_per_gpu=2", "trainer.export_hf=false", *overrides]


@pytest.mark.slow  # 2 ranks: ~60 s on a loaded 2-core machine (data path: tests/data/test_hub_datasets.py)
def test_sft_recipe_trains_on_a_cached_hub_dataset_id(tmp_path):
    rows = [{"prompt": f"{i}+1=", "response": str(i + 1)} for i in range(8)]
    write_cached_dataset(tmp_path / "hf_home" / "hub", "tiny-org/tiny-sft", {
        "data/train-00000-of-00001.parquet": parquet_bytes(rows),
        "data/test-00000-of-00001.parquet": parquet_bytes(rows[:2]),
    })
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("HF_HUB_CACHE", None)
    args = _args(tmp_path, "data.train_files=tiny-org/tiny-sft", "data.val_files=tiny-org/tiny-sft",
                 devices=2)  # both ranks read the cache
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "sft.py"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "before training" in proc.stdout and "after training" in proc.stdout  # val: the test split
    metrics = read_csv_metrics(tmp_path / "run")
    assert all("sft/loss" in metrics[step] for step in (1, 2)), metrics
    assert not (tmp_path / "task").exists()  # the demo's task is not written for the user's data


def test_sft_recipe_with_a_hub_dataset_id_not_in_the_cache_fails_before_any_model_loads(tmp_path,
                                                                                        monkeypatch):
    """The recipe's ``main`` in this process: it fails in its checks, before any Trainer runs."""
    from verl_trainer.data.hub import HubDatasetNotFoundError
    from verl_trainer.recipes import sft

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    with pytest.raises(HubDatasetNotFoundError) as missing:
        sft.main(_args(tmp_path, "data.train_files=openai/gsm8k"))
    message = str(missing.value)
    assert message.startswith("data.train_files='openai/gsm8k' is not a local file, and it looks like a hub "
                              "dataset id but 'openai/gsm8k' is not in the local HF hub cache")
    assert str(tmp_path / "hf_home" / "hub" / "datasets--openai--gsm8k") in message
    assert "huggingface-cli download --repo-type dataset openai/gsm8k" in message
    assert not list((tmp_path / "run").glob("**/step_*")) and not list((tmp_path / "run").glob("**/*.csv"))
