"""A GRPO run does not depend on the device count: 3 steps at dp=1 and dp=2 (HF rollout, real gloo ranks)
sample the same responses (each from its own seed: (seed, step, prompt index, sample index)), log the same
losses and metrics — the train/inference mismatch and the importance-weighted (TIS) loss included — and
end with the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.algorithms.short_grpo import make_assets, short_grpo_config
from verl_trainer.testing import run_distributed

STEPS = 3


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return make_assets(tmp_path_factory.mktemp("dp_rollout"))


def _grpo_fit(model: str, data: str, root: str) -> dict:
    from verl_trainer import Trainer
    from verl_trainer.algorithms import GRPO, PromptDataModule
    from verl_trainer.callbacks import Callback
    from verl_trainer.data import schema
    from verl_trainer.models.loading import load_tokenizer

    class Record(Callback):
        def __init__(self) -> None:
            self.responses: list[list[tuple]] = []
            self.rollout_log_probs: list[dict[tuple, float]] = []
            self.metrics: list[dict[str, float]] = []

        def on_rollout_end(self, trainer, module, batch) -> None:
            ids, lengths = batch[schema.INPUT_IDS], batch[schema.SEQ_LEN]
            rows = [tuple(ids[i, : int(n)].tolist()) for i, n in enumerate(lengths)]
            self.responses.append(rows)
            self.rollout_log_probs.append({r: float(batch[schema.ROLLOUT_LOG_PROBS][i].sum())
                                           for i, r in enumerate(rows)})

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.metrics.append(dict(trainer.callback_metrics))

    cfg = short_grpo_config(model, data)
    record = Record()
    trainer = Trainer(devices=dist.get_world_size(), max_steps=STEPS, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, default_root_dir=root,
                      val_check_interval=None, callbacks=[record], seed=7)
    module = GRPO(cfg.algorithm)
    trainer.fit(module, datamodule=PromptDataModule(cfg.data, load_tokenizer(model)))
    params = {n: t.detach().clone() for n, t in module.actor.get_per_tensor_param()}
    return {"responses": record.responses, "log_probs": record.rollout_log_probs, "metrics": record.metrics,
            "params": params if dist.get_rank() == 0 else None}


@pytest.mark.slow
def test_three_grpo_steps_at_dp1_and_dp2_are_the_same_run(assets, tmp_path):
    args = (str(assets / "model"), str(assets / "data"))
    one = run_distributed(_grpo_fit, 1, *args, str(tmp_path / "dp1"), timeout=600)[0]
    two = run_distributed(_grpo_fit, 2, *args, str(tmp_path / "dp2"), timeout=600)
    for step in range(STEPS):
        merged = sorted(two[0]["responses"][step] + two[1]["responses"][step])
        assert merged == sorted(one["responses"][step]), f"step {step}: other responses at dp=2"
        assert len(set(merged)) > 4  # sampled, not all equal
        for rank in two:  # the sampler's log-probs of each response agree too
            for row, lp in rank["log_probs"][step].items():
                assert lp == pytest.approx(one["log_probs"][step][row], abs=1e-4)
        want, got = one["metrics"][step], two[0]["metrics"][step]
        assert two[1]["metrics"][step] == got  # every rank logs the reduced values
        for key in ("actor/pg_loss", "actor/grad_norm", "reward/mean", "rollout_corr/kl",
                    "rollout_corr/log_prob_abs_diff_max", "rollout_corr/rollout_is_mean"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), (step, key)
    assert abs(one["metrics"][0]["rollout_corr/log_prob_abs_diff_max"]) < 1e-4  # rollout = actor weights
    for name, tensor in one["params"].items():
        torch.testing.assert_close(two[0]["params"][name], tensor, rtol=1e-4, atol=1e-5)
