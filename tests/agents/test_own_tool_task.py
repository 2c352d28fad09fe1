"""docs/agents.md's "Your own tool task, from data to trained model", run as written: a tool file that
imports its sibling, chat prompts, a TRL-style reward, SFT traces in the documented format, then
``recipes/sft.py`` and ``recipes/grpo.py`` with multi-turn on (a tiny model; a handful of steps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from verl_trainer.models import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
WORDS = {"cat": "feline", "dog": "canine", "cow": "bovine", "pig": "porcine"}


def _write_task(task: Path) -> None:
    task.mkdir()
    (task / "words.py").write_text(f"WORDS = {WORDS!r}\n")
    (task / "tools.py").write_text(textwrap.dedent('''
        from words import WORDS

        def lookup(word: str) -> str:
            """Look a word up in the dictionary.

            Args:
                word: The word.
            """
            return WORDS.get(word, "not found")
    '''))
    (task / "reward.py").write_text(textwrap.dedent('''
        def answered(completions, ground_truth, **kwargs):
            return [float(gt in c[-1]["content"] and any(m["role"] == "tool" for m in c))
                    for c, gt in zip(completions, ground_truth)]
    '''))
    prompts = [{"prompt": [{"role": "user", "content": w}], "ground_truth": m, "data_source": "lookup"}
               for w, m in WORDS.items()]
    (task / "train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    traces = []
    for word, meaning in WORDS.items():  # the tiny template ends a message with a newline: eos text added
        call = json.dumps({"name": "lookup", "arguments": {"word": word}})
        traces.append({"messages": [{"role": "user", "content": word},
                                    {"role": "assistant", "content": f"<tool_call>{call}</tool_call><eos>"},
                                    {"role": "tool", "content": meaning},
                                    {"role": "assistant", "content": f"{meaning}<eos>"}]})
    (task / "sft.jsonl").write_text("".join(json.dumps(t) + "\n" for t in traces * 4))


def _run(cwd: Path, recipe: str, *args: str) -> str:
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / recipe), "trainer.logger=[csv]",
                           "trainer.enable_checkpointing=false", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_the_documented_own_tool_task_trains_end_to_end(tmp_path):
    model = make_tiny_model(tmp_path / "model", arch="qwen2", hidden_size=32, num_hidden_layers=1, seed=3)
    _write_task(tmp_path / "my_task")
    _run(tmp_path, "sft.py", f"model.path={model}", "data.train_files=my_task/sft.jsonl",
         "data.val_files=my_task/sft.jsonl", "data.max_length=128", "data.train_batch_size=16",
         "algorithm.engine.micro_batch_size_per_gpu=16", "trainer.max_steps=150", "algorithm.optim.lr=1e-2",
         "trainer.val_check_interval=null", "trainer.default_root_dir=outputs/my_sft")
    out = _run(tmp_path, "grpo.py", "model.path=outputs/my_sft/hf", "data.train_files=my_task/train.jsonl",
               "data.val_files=my_task/train.jsonl", "algorithm.reward.name=my_task/reward.py:answered",
               "algorithm.rollout.multi_turn.enable=true",
               "algorithm.rollout.multi_turn.tools=[my_task/tools.py:lookup]",
               "algorithm.rollout.multi_turn.tools_in_prompt=false", "algorithm.rollout.max_new_tokens=128",
               "algorithm.val_rollout.log_generations=2", "data.train_batch_size=4", "algorithm.rollout.n=2",
               "data.max_prompt_length=64", "trainer.max_steps=1", "trainer.val_check_interval=1",
               "trainer.export_hf=false",
               "trainer.default_root_dir=outputs/my_grpo")
    assert "[validation generations, step" in out
    files = sorted((tmp_path / "outputs" / "my_grpo" / "generations").glob("val_step_*.jsonl"))
    rows = [json.loads(line) for line in files[-1].read_text().splitlines()]
    assert len(rows) == 2
    tool_turns = [m for r in rows for m in r["messages"] if m["role"] == "tool"]
    assert tool_turns and all(m["content"] in WORDS.values() for m in tool_turns), rows  # lookup ran
