"""A GRPO step in which the policy writes hostile programs for a code task: the step finishes, the trainer
and the checkout are untouched, the hostile samples score 0 and are counted (``reward/code_errors``,
``reward/code_timeouts``), the honest ones score 1.

The policy is scripted (an ``HFRollout`` whose responses are the programs below, in turn): a tiny model
cannot write these programs, and the scripted responses go through the same reward, advantage and update
path as sampled ones.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest

import verl_trainer
from tests.algorithms.short_grpo import make_assets, short_grpo_config
from verl_trainer.data import schema
from verl_trainer.rollout.hf import HFRollout
from verl_trainer.testing import run_distributed

HONEST = "a, b = map(int, input().split())\nprint(a + b)\n"
FORK_LOOP = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
PROGRAMS = [
    HONEST,
    "import os, signal\nprint(open(f'/proc/{os.getppid()}/environ').read())\nos.kill(os.getppid(), 9)\n",
    f"open({verl_trainer.__file__!r}, 'a').write('raise SystemExit')\nprint(3)\n",
    FORK_LOOP,
    "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\nraise SystemExit(1)\n",
    HONEST,
]
HOSTILE_TIMEOUTS = 1  # the fork loop runs until the time limit


class ScriptedPolicy(HFRollout):
    """Responses are :data:`PROGRAMS`, in turn (log-probs 0: rollout correction is off)."""

    def generate_token_ids(self, prompts, config, seeds):
        ids = [self.tokenizer.encode(PROGRAMS[k % len(PROGRAMS)], add_special_tokens=False)
               + [self.tokenizer.eos_token_id] for k in range(len(prompts))]
        return ids, [[0.0] * len(i) for i in ids]


def _code_task(path: Path) -> Path:
    path.mkdir()
    cases = json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})
    rows = [{"data_source": "code", "prompt": f"add{i}:", "reward_model": {"ground_truth": cases},
             "extra_info": {"index": i}} for i in range(2)]
    for split in ("train", "val"):
        (path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _hostile_fit(model: str, data: str, root: str) -> dict:
    from verl_trainer import Trainer
    from verl_trainer.algorithms import GRPO, PromptDataModule
    from verl_trainer.callbacks import Callback
    from verl_trainer.models.loading import load_tokenizer

    cfg = short_grpo_config(model, data, "algorithm.reward.name=default_compute_score",
                            "algorithm.rollout.n=3", "data.train_batch_size=2",
                            "algorithm.actor.ppo_mini_batch_size=2", "algorithm.rollout.max_new_tokens=128",
                            "algorithm.rollout_correction.level=null")
    seen: dict = {}

    class Record(Callback):
        def on_rollout_end(self, trainer, module, batch) -> None:
            seen["scores"] = batch[schema.TOKEN_LEVEL_SCORES].sum(-1).tolist()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            seen["metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items()}

    module = GRPO(cfg.algorithm)
    module.rollout = ScriptedPolicy(cfg.algorithm.rollout, model)
    trainer = Trainer(devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, default_root_dir=root, val_check_interval=None,
                      callbacks=[Record()], seed=3)
    trainer.fit(module, datamodule=PromptDataModule(cfg.data, load_tokenizer(model)))
    return {**seen, "step": trainer.global_step}


@pytest.mark.slow
def test_a_grpo_step_with_hostile_programs_finishes_with_them_scored_zero_and_counted(tmp_path):
    model = str(make_assets(tmp_path) / "model")
    data = _code_task(tmp_path / "code")
    init = Path(verl_trainer.__file__)
    before = hashlib.sha256(init.read_bytes()).hexdigest()
    out = run_distributed(_hostile_fit, 1, model, str(data), str(tmp_path / "run"), timeout=600)[0]

    assert out["step"] == 1
    assert out["scores"] == [1.0 if p == HONEST else 0.0 for p in PROGRAMS]
    hostile = len(PROGRAMS) - PROGRAMS.count(HONEST)
    metrics = out["metrics"]
    assert metrics["reward/code_errors"] == pytest.approx(hostile / len(PROGRAMS))
    assert metrics["reward/code_timeouts"] == pytest.approx(HOSTILE_TIMEOUTS / len(PROGRAMS))
    assert math.isfinite(metrics["actor/pg_loss"])
    assert hashlib.sha256(init.read_bytes()).hexdigest() == before
