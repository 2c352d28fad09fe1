"""GRPO trains 2 steps through the token server with external agents (single-turn token ids, two-turn chat),
configured by ``multi_turn.agent``: every trained response is exactly the ids the server returned."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from verl_trainer.data.prompts import save_rows, to_verl_row
from verl_trainer.models.tiny import make_tiny_model
from verl_trainer.testing import run_distributed

QUESTIONS = ("2+3=", "4+4=", "7+1=", "5+2=")


def _fit(base: str, agent: str) -> dict:
    from tests.serving import agents
    from verl_trainer import Trainer
    from verl_trainer.algorithms import GRPO, PromptDataModule
    from verl_trainer.callbacks import Callback
    from verl_trainer.data import schema
    from verl_trainer.models.loading import load_tokenizer
    from verl_trainer.recipe_config import GRPORecipeConfig, load_config
    from verl_trainer.rollout import AGENT_INFO

    checked = []
    agents.SERVED.clear()  # the first turns of both agents are the same ids (same seeds)

    class Check(Callback):
        def on_rollout_end(self, trainer, module, batch) -> None:
            for i in range(batch.batch_size[0]):
                p, r = int(batch[schema.PROMPT_LEN][i]), int(batch[schema.RESPONSE_LEN][i])
                ids = batch[schema.INPUT_IDS][i, p: p + r].tolist()
                mask = batch[schema.LOSS_MASK][i, p: p + r].tolist()
                sampled = [t for t, m in zip(ids, mask) if m]
                served = next(v for v in agents.SERVED.values()
                              if [t for a in v for t in a["choices"][0]["token_ids"]] == sampled)
                assert served[0]["prompt_token_ids"] == batch[schema.INPUT_IDS][i, :p].tolist()
                assert batch[AGENT_INFO][i]["turns"] == len(served), (batch[AGENT_INFO][i], served)
            checked.append(batch.batch_size[0])

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    metrics: list[dict] = []
    overrides = [
        f"algorithm.model_path={base}/model", f"data.train_files={base}/train.jsonl",
        f"data.val_files={base}/train.jsonl",
        "data.train_batch_size=4", "data.max_prompt_length=32", "algorithm.rollout.n=2",
        "algorithm.rollout.max_new_tokens=64", "algorithm.actor.ppo_mini_batch_size=4",
        "algorithm.rollout.multi_turn.enable=true", f"algorithm.rollout.multi_turn.agent={agent}",
        "algorithm.reward.name=math",
    ]
    cfg = load_config(GRPORecipeConfig, Path(__file__).resolve().parents[2] / "configs" / "grpo.yaml",
                      overrides)
    trainer = Trainer(devices=dist.get_world_size(), max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, default_root_dir=f"{base}/run-{agent[-10:]}",
                      val_check_interval=None, callbacks=[Check()], seed=7)
    module = GRPO(cfg.algorithm)
    trainer.fit(module, datamodule=PromptDataModule(cfg.data, load_tokenizer(f"{base}/model")))
    module.rollout.agent_loop.close()
    return {"checked": checked, "metrics": metrics}


def fit_both(base: str) -> dict:
    """Both agents, one after the other, in one rank (one spawn)."""
    return {name: _fit(base, f"tests.serving.agents:{name}") for name in ("single_turn_agent", "chat_agent")}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("grpo_served")
    make_tiny_model(base / "model", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1)
    rows = [to_verl_row([{"role": "user", "content": q}], str(eval(q[:-1])), "arithmetic",  # noqa: S307
                        {"question": q}) for q in QUESTIONS]
    save_rows(rows, base / "train.jsonl")
    return base


def test_grpo_trains_two_steps_through_the_token_server(assets):
    out = run_distributed(fit_both, 1, str(assets), timeout=600)[0]
    for name, turns in (("single_turn_agent", 1.0), ("chat_agent", 2.0)):
        result = out[name]
        assert result["checked"] == [8, 8], name
        assert len(result["metrics"]) == 2
        for step in result["metrics"]:
            assert step["agent/turns"] == turns and step["agent/env_errors"] == 0.0, (name, step)
            assert "actor/pg_loss" in step and "agent/env_reward" in step
    chat = out["chat_agent"]["metrics"]
    assert all(m["agent/tool_token_share"] > 0 for m in chat)  # the follow-up is masked observation
