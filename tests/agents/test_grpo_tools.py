"""GRPO with the calculator tool, at dp=1 and at dp=2 with dynamic micro-batches (real gloo ranks): the same
multi-turn trajectories, the same losses and metrics and the same final weights; the loss mask covers
exactly the model's tokens. Validation after the fit reports the agent metrics (``val/agent/*``) with the
same values at both sizes: 3 validation prompts on 2 ranks make one padding sample, which must count
nowhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.agents.common import QUESTIONS, tool_policy
from verl_trainer.data.prompts import save_rows, to_verl_row
from verl_trainer.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
VAL_ROWS = 3
AGENT_VAL = ("val/agent/turns", "val/agent/tool_calls", "val/agent/tool_errors", "val/agent/correct_tool_use",
             "val/agent/tool_calls/calculator", "val/agent/tool_token_share", "val/reward/mean")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("grpo_tools")
    tool_policy(base / "model")
    rows = [to_verl_row([{"role": "user", "content": q}], str(eval(q[:-1])), "arithmetic") for q in QUESTIONS]
    save_rows(rows, base / "train.jsonl")
    save_rows(rows[:VAL_ROWS], base / "val.jsonl")
    return base


def _fit(base: str, root: str, dynamic: bool) -> dict:
    from verl_trainer import Trainer
    from verl_trainer.algorithms import GRPO, PromptDataModule
    from verl_trainer.callbacks import Callback
    from verl_trainer.configs import GRPORecipeConfig, load_config
    from verl_trainer.data import schema
    from verl_trainer.models.loading import load_tokenizer
    from verl_trainer.rollout import AGENT_INFO

    class Record(Callback):
        def __init__(self) -> None:
            self.rows: list[list[tuple]] = []
            self.metrics: list[dict[str, float]] = []

        def on_rollout_end(self, trainer, module, batch) -> None:
            step = []
            for i in range(batch.batch_size[0]):
                n, p = int(batch[schema.SEQ_LEN][i]), int(batch[schema.PROMPT_LEN][i])
                mask = batch[schema.LOSS_MASK][i]
                info = batch[AGENT_INFO][i]
                assert int((mask[p:n] == 0).sum()) == info["observation_tokens"]  # observations masked
                assert float(mask[:p].sum()) == 0.0 and float(mask[n:].sum()) == 0.0
                assert torch.equal(batch[schema.ROLLOUT_LOG_PROBS][i][mask == 0],
                                   torch.zeros(int((mask == 0).sum())))
                step.append((tuple(batch[schema.INPUT_IDS][i, :n].tolist()), tuple(mask[:n].tolist())))
            self.rows.append(step)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.metrics.append(dict(trainer.callback_metrics))

    overrides = [
        f"algorithm.model_path={base}/model", f"data.train_files={base}/train.jsonl",
        f"data.val_files={base}/val.jsonl",
        "data.train_batch_size=4", "data.max_prompt_length=32", "algorithm.rollout.n=2",
        "algorithm.rollout.max_new_tokens=120", "algorithm.rollout.temperature=1.0",
        "algorithm.actor.ppo_mini_batch_size=4", "algorithm.actor.optim.lr=1e-4",
        "algorithm.rollout.multi_turn.enable=true", "algorithm.rollout.multi_turn.max_turns=2",
        "algorithm.rollout.multi_turn.tools=[verl_trainer.agents.builtin_tools:calculator]",
        "algorithm.reward.name=math", "algorithm.rollout_correction.level=token",
    ]
    if dynamic:
        overrides += ["algorithm.actor.engine.use_dynamic_bsz=true",
                      "algorithm.actor.engine.max_token_len_per_gpu=200"]
    cfg = load_config(GRPORecipeConfig, ROOT / "configs" / "grpo.yaml", overrides)
    record = Record()
    trainer = Trainer(devices=dist.get_world_size(), max_steps=STEPS, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, default_root_dir=root,
                      val_check_interval=None, callbacks=[record], seed=7)
    module = GRPO(cfg.algorithm)
    data = PromptDataModule(cfg.data, load_tokenizer(f"{base}/model"))
    trainer.fit(module, datamodule=data)
    params = {n: t.detach().clone() for n, t in module.actor.get_per_tensor_param()}
    rank0 = dist.get_rank() == 0
    val = trainer.validate(module, datamodule=data)[0]
    return {"rows": record.rows, "metrics": record.metrics, "params": params if rank0 else None, "val": val}


@pytest.mark.slow
def test_grpo_with_the_calculator_is_the_same_run_at_dp1_and_dp2_with_dynamic_micro_batches(assets, tmp_path):
    one = run_distributed(_fit, 1, str(assets), str(tmp_path / "dp1"), False, timeout=900)[0]
    two = run_distributed(_fit, 2, str(assets), str(tmp_path / "dp2"), True, timeout=900)
    for step in range(STEPS):
        assert sorted(two[0]["rows"][step] + two[1]["rows"][step]) == sorted(one["rows"][step]), step
        want, got = one["metrics"][step], two[0]["metrics"][step]
        assert got["agent/tool_calls"] > 0 and got["agent/tool_token_share"] > 0  # the tool was used
        for key in ("actor/pg_loss", "actor/grad_norm", "reward/mean", "agent/turns", "agent/tool_calls",
                    "agent/tool_calls/calculator", "agent/tool_token_share", "rollout_corr/kl"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), (step, key)
    for name, tensor in one["params"].items():
        torch.testing.assert_close(two[0]["params"][name], tensor, rtol=1e-4, atol=1e-5)
    assert two[0]["val"] == two[1]["val"], "every rank logs the same reduced validation metrics"
    assert one["val"]["val/agent/tool_calls"] > 0 and one["val"]["val/agent/correct_tool_use"] > 0
    for key in AGENT_VAL:
        assert two[0]["val"][key] == pytest.approx(one["val"][key], rel=1e-6, abs=1e-7), key
