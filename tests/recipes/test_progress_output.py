"""What a recipe prints when its output is a log file or a pipe, and how often it validates (issue 47 item 8).

One SFT recipe run as ``python recipes/sft.py ... | tee log`` would be: stdout is a pipe, the console 40
columns wide (``COLUMNS=40``, narrower than the lines), ``max_steps`` a multiple of ``val_check_interval``.
A callback given by file (``trainer.callbacks``) counts the validation passes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.recipes.test_recipes import make_recipe_assets

ROOT = Path(__file__).resolve().parents[2]

COUNTER = '''
from pathlib import Path

from verl_trainer.callbacks import Callback


class CountValidations(Callback):
    def on_validation_start(self, trainer, module):
        with open(Path(__file__).with_suffix(".log"), "a") as f:
            f.write(f"{trainer.global_step}\\n")
'''


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return make_recipe_assets(tmp_path_factory.mktemp("progress_assets"))


def test_a_piped_run_prints_whole_lines_and_validates_once_at_the_last_step(assets, tmp_path):
    counter = tmp_path / "count.py"
    counter.write_text(COUNTER)
    args = [
        sys.executable, str(ROOT / "recipes" / "sft.py"), "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "trainer.validate_before_fit=false", "trainer.logger=[csv]", "trainer.enable_checkpointing=true",
        "trainer.checkpoint.every_n_train_steps=2",  # a checkpoint at a validation step flushes its values
        "trainer.export_hf=false", f"trainer.callbacks=['{counter}:CountValidations']",
        f"trainer.default_root_dir={tmp_path / 'run'}", f"model.path={assets / 'model'}",
        "model.make_tiny_if_missing=false", f"task.dir={assets / 'data'}", "task.write_if_missing=false",
        "data.train_batch_size=4", "algorithm.engine.micro_batch_size_per_gpu=4",
    ]
    env = {**os.environ, "COLUMNS": "40", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["1/4", "2/4", "3/4", "4/4"], proc.stdout
    for line in steps:  # one line per step, longer than the console, neither wrapped nor cut
        assert "sft/loss=" in line and " eta " in line, line
    assert max(len(line) for line in steps) > 40
    (done,) = [line for line in lines if line.startswith("done: step 4")]
    assert "sft/loss=" in done and "val/loss=" in done and done.split()[-2] == "in", done
    assert not any(line.strip() and set(line.strip()) <= set("━╸╺ ") for line in lines), "a bar in a pipe"
    # validations: after steps 2 and 4 in fit; the report's "after training" is step 4's, not a third pass
    assert counter.with_suffix(".log").read_text().split() == ["2", "4"]
    (after,) = [line for line in lines if line.startswith("val/loss")]
    assert "after training:" in after and "n/a" not in after.split("after training:")[1], after
