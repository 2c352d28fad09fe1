"""RL data as TRL users bring it (issue 29 item 4): a ``datasets.Dataset`` with TRL's ``solution`` column,
its columns passed by name to TRL-style rewards in a real GRPO fit, prompt-only data for rewards that need
no ground truth, and clear refusals where a reward does need one or ``fit`` gets raw rows."""

from __future__ import annotations

import pytest

from verl_trainer.data.prompts import PromptDataset
from verl_trainer.models.loading import load_tokenizer
from verl_trainer.models.tiny import build_tokenizer, make_tiny_model
from verl_trainer.rewards.compute import compute_rewards
from verl_trainer.rewards.failures import RewardError
from verl_trainer.testing.ranks import run_distributed

datasets = pytest.importorskip("datasets")

SEEN: dict[str, list] = {"solution": [], "level": [], "ids": [], "state": []}


def accuracy_reward(completions, solution, **kwargs):
    """TRL's signature: the ``solution`` column by name."""
    SEEN["solution"] += list(solution)
    SEEN["level"] += list(kwargs["level"])
    return [float(c.strip() == s) for c, s in zip(completions, solution)]


def short_reward(completions, **kwargs):
    """Needs no ground truth (a length reward)."""
    return [1.0 / (1 + len(c)) for c in completions]


def token_reward(completions, completion_ids, trainer_state, log_metric, **kwargs):
    """TRL's run-level arguments (issue 29 item 10): token ids, the trainer's state, a metric logger."""
    SEEN["ids"] += [len(ids) for ids in completion_ids]
    SEEN["state"].append((trainer_state.global_step, trainer_state.epoch, trainer_state.max_steps))
    log_metric("custom/mean_ids", sum(len(ids) for ids in completion_ids) / len(completion_ids))
    return [0.0 for _ in completions]


def test_prompt_dataset_reads_a_datasets_dataset_with_trl_columns():
    tok = build_tokenizer()
    standard = datasets.Dataset.from_list([{"prompt": "1+1=", "solution": "2", "level": 1}])
    ds = PromptDataset(standard, tok, max_prompt_length=32)
    assert ds[0]["ground_truth"] == "2"  # TRL's solution is the ground truth verl-style rewards get
    assert ds[0]["columns"] == {"prompt": "1+1=", "solution": "2", "level": 1}  # TRL rewards: by name
    prompt_only = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "2+2="}]}])
    ds = PromptDataset(prompt_only, tok, max_prompt_length=32)
    assert ds[0]["ground_truth"] is None  # optional
    assert ds[0]["columns"]["prompt"] == [{"role": "user", "content": "2+2="}]
    assert tok.decode(ds[0]["input_ids"]) == "user: 2+2=\nassistant: "  # through the chat template


def test_a_reward_that_needs_the_ground_truth_names_the_fix_and_one_that_does_not_scores():
    texts, truths, sources = ["4", "12345"], [None, None], ["a", "a"]
    scores = compute_rewards(texts, truths, sources, short_reward, columns=[{"prompt": "x"}] * 2)
    assert scores.tolist() == pytest.approx([0.5, 1 / 6])
    assert compute_rewards(texts, truths, sources, "format").tolist() == [1.0, 1.0]
    for name in ("math", "math_exact"):
        with pytest.raises(RewardError, match=f"reward '{name}' compares the answer with the ground truth, "
                                             "and this prompt has none: .*TRL's solution"):
            compute_rewards(texts, truths, sources, name)


def test_fit_refuses_raw_rows_naming_the_datamodule(tmp_path):
    from verl_trainer import Trainer
    from verl_trainer.algorithms import GRPO
    from verl_trainer.algorithms.config import GRPOConfig

    trainer = Trainer(devices=1, accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                      default_root_dir=str(tmp_path))
    rows = datasets.Dataset.from_list([{"prompt": "1+1=", "solution": "2"}] * 4)
    with pytest.raises(TypeError, match=r"the datamodule is a Dataset of rows, which needs tokenising and "
                                        r"batching: pass datamodule=PromptDataModule\(.*train_dataset=ds\)"):
        trainer.fit(GRPO(GRPOConfig(model_path="/nonexistent/model")), datamodule=rows)  # before any load


def _fit_on_trl_dataset(root: str) -> dict:
    """One GRPO step on a ``datasets.Dataset`` (in its own process: a fit leaves its process group)."""
    from verl_trainer import Trainer
    from verl_trainer.algorithms import GRPO, PromptDataModule
    from verl_trainer.algorithms.config import GRPOConfig, RewardConfig, RolloutConfig
    from verl_trainer.algorithms.data import DataConfig

    model = make_tiny_model(f"{root}/m", hidden_size=16, num_attention_heads=2, num_key_value_heads=1)
    rows = datasets.Dataset.from_list([{"prompt": f"{i}+1=", "solution": str(i + 1), "level": i % 3}
                                       for i in range(4)])
    cfg = GRPOConfig(model_path=str(model), rollout=RolloutConfig(n=2, max_new_tokens=2),
                     reward=RewardConfig(name=[accuracy_reward, short_reward, token_reward]))
    cfg.actor.ppo_mini_batch_size = 4
    data = PromptDataModule(DataConfig(train_batch_size=4, max_prompt_length=16), load_tokenizer(model),
                            train_dataset=rows)
    for seen in SEEN.values():
        seen.clear()
    trainer = Trainer(devices=1, accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, default_root_dir=f"{root}/run")
    trainer.fit(GRPO(cfg), datamodule=data)
    return {"step": trainer.global_step, "seen": {k: list(v) for k, v in SEEN.items()},
            "metrics": sorted(trainer.callback_metrics),
            "mean_ids": trainer.callback_metrics["custom/mean_ids"]}


def test_grpo_fit_on_a_trl_dataset_passes_solution_and_columns_to_trl_rewards(tmp_path):
    (out,) = run_distributed(_fit_on_trl_dataset, 1, str(tmp_path))
    assert out["step"] == 1
    assert sorted(out["seen"]["solution"]) == sorted([str(i + 1) for i in range(4)] * 2)  # n=2 per prompt
    assert sorted(out["seen"]["level"]) == sorted([i % 3 for i in range(4)] * 2)
    assert any("accuracy_reward" in k for k in out["metrics"]), out["metrics"]
    ids = out["seen"]["ids"]  # completion_ids: 1..max_new_tokens=2 token ids per response
    assert len(ids) == 8 and all(1 <= n <= 2 for n in ids)
    assert out["seen"]["state"] == [(0, 0, 1)]  # trainer_state: before the first step, max_steps=1
    assert out["mean_ids"] == pytest.approx(sum(ids) / len(ids))  # log_metric


def test_a_missing_data_file_says_where_relative_paths_start():
    """(Hub dataset ids, ``data.train_files=openai/gsm8k``: ``tests/data/test_hub_datasets.py``.)"""
    from verl_trainer.algorithms.data import DataConfig, PromptDataModule

    module = PromptDataModule(DataConfig(train_files="missing/train.parquet", train_batch_size=2),
                              build_tokenizer())
    with pytest.raises(FileNotFoundError, match=r"does not exist \(relative paths start at [^;]*\)$"):
        module.check(dp_size=1)
