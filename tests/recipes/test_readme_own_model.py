"""The README's "Train your own model" section, run as written on a tiny model (issue 13 item 6).

Python blocks whose first line is ``# <name>.py`` are written to that file; bash blocks run in order in a
fresh directory that links ``recipes/``. The first bash block (the user's own paths) is replaced by this
test's; the training command gets overrides appended that make it two short steps.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from verl_trainer.models.tiny import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
FAST = ("trainer.max_steps=2 data.train_batch_size=4 algorithm.rollout.n=2 "
        "algorithm.rollout.max_new_tokens=4 trainer.val_check_interval=null trainer.logger=[csv] "
        "algorithm.actor.engine.micro_batch_size_per_gpu=8")


def readme_section(title: str) -> list[tuple[str, str]]:
    """The fenced blocks ``(language, text)`` of the README section ``## title``."""
    text = (ROOT / "README.md").read_text()
    section = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)


def test_train_your_own_model_section_runs_as_written(tmp_path):
    blocks = readme_section("Train your own model")
    bash = [body for lang, body in blocks if lang == "bash"]
    files = {body.splitlines()[0][2:].strip(): body for lang, body in blocks if lang == "python"}
    assert set(files) == {"make_data.py", "my_reward.py", "evaluate.py"}, sorted(files)
    assert bash[0].startswith("export MODEL=") and "recipes/grpo.py" in bash[1], bash

    work = tmp_path / "work"
    work.mkdir()
    (work / "recipes").symlink_to(ROOT / "recipes")
    for name, body in files.items():
        (work / name).write_text(body)
    model = make_tiny_model(tmp_path / "my_model", hidden_size=32, num_attention_heads=4,
                            num_key_value_heads=2)
    env = {**os.environ, "MODEL": str(model), "RUN": str(tmp_path / "run"), "WANDB_MODE": "offline",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "PYTHONUNBUFFERED": "1"}
    outputs = []
    for i, body in enumerate(bash[1:], start=1):
        script = body.rstrip() + (f" {FAST}" if "recipes/grpo.py" in body else "")
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=work, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"README bash block {i} failed:\n{script}\n{proc.stdout[-3000:]}\n" \
                                     f"{proc.stderr[-5000:]}"
        outputs.append(proc.stdout)
    exported = tmp_path / "run" / "hf"
    assert (exported / "config.json").is_file() and (exported / "model.safetensors").is_file()
    assert f"HF model:  {exported}" in outputs[0]
    assert re.search(rf"{re.escape(str(exported))}: mean reward \d\.\d{{3}} on 32 validation prompts",
                     outputs[1]), outputs[1]
