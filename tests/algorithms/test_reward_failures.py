"""Failed reward calls (raise, time out, not a number): counted, then error / drop / zero.

Unit: RewardFunctions records each failure (function, data source, sample); compute_rewards raises under
``error``; ``zero`` scores 0; the RL check drops whole groups. 2 real gloo ranks: a failure on one rank
raises the same error on both (no rank left waiting) and the counts are over both ranks. ``slow``: GRPO at 2
ranks with a reward that raises on one rank's samples: ``error`` stops step 1 on both ranks, ``drop`` trains.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from tensordict import NonTensorStack

from verl_trainer.algorithms.config import RewardConfig
from verl_trainer.algorithms.stages.guard import check_reward_failures
from verl_trainer.data import schema
from verl_trainer.data.packing import make_batch
from verl_trainer.rewards import RewardFunctions, compute_rewards, place_scores, score_responses
from verl_trainer.rewards.failures import RewardError
from verl_trainer.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]


def flaky(data_source, solution_str, ground_truth, extra_info=None):
    """Raises on "boom", times out on "slow", returns None on "none", else 1."""
    if solution_str == "boom":
        raise ValueError("cannot parse")
    if solution_str == "slow":
        raise TimeoutError("ran past 1 s")
    if solution_str == "none":
        return None
    return 1.0


def test_failures_are_recorded_and_raised_under_error():
    texts = ["ok", "boom", "slow", "none"]
    want = (r"3 reward call\(s\) failed: reward function flaky failed on sample 1 \(data source 'gsm8k', "
            r"response 'boom'\): ValueError: cannot parse")
    with pytest.raises(RewardError, match=want):
        compute_rewards(texts, ["1"] * 4, ["gsm8k"] * 4, flaky)
    fns = RewardFunctions([flaky, "math"], on_error="zero")
    scores, info = compute_rewards(texts, ["1"] * 4, ["gsm8k"] * 4, fns, return_info=True)
    assert scores.tolist() == [1.0, 0.0, 0.0, 0.0]  # flaky's share of the failed ones is 0; math gives 0
    got = [(f.function, f.index, f.timeout) for f in fns.failures]
    assert got == [("flaky", 1, False), ("flaky", 2, True), ("flaky", 3, False)]
    assert fns.failures[2].message.startswith("returned NoneType None; it must return a number")
    assert info["_failed"].tolist() == [0, 1, 1, 1] and info["_timed_out"].tolist() == [0, 0, 1, 0]
    with pytest.raises(ValueError, match=r"on_error='skip'; choose one of \('error', 'drop', 'zero'\)"):
        RewardConfig(on_error="skip")


def _scored_batch(texts: list[str], fns: RewardFunctions) -> tuple:
    batch = make_batch([[4, 5]] * len(texts), [[6]] * len(texts), uids=[0, 0, 1, 1][: len(texts)])
    batch["response_text"] = NonTensorStack.from_list(texts)
    batch["data_source"] = NonTensorStack.from_list(["gsm8k"] * len(texts))
    batch["ground_truth"] = NonTensorStack.from_list(["1"] * len(texts))
    scores, info = score_responses(batch, fns, raise_on_error=False)
    return batch, scores, info, place_scores(batch, scores, info).metrics


def test_drop_takes_the_whole_group_and_counts():
    fns = RewardFunctions(flaky, on_error="drop")
    batch, scores, info, _ = _scored_batch(["ok", "ok", "slow", "ok"], fns)
    metrics = {}
    dropped = check_reward_failures(fns, batch, scores, info, 3, None, metrics, group_estimator=True)
    assert dropped == 2 and schema.real_mask(batch).tolist() == [True, True, False, False]
    assert metrics == {"reward/errors": 0.0, "reward/timeouts": 1.0, "reward/dropped_samples": 2.0}
    fns = RewardFunctions(flaky, on_error="zero")
    batch, scores, info, _ = _scored_batch(["boom", "ok"], fns)
    metrics = {}
    assert check_reward_failures(fns, batch, scores, info, 3, None, metrics) == 0
    assert metrics == {"reward/errors": 1.0, "reward/timeouts": 0.0} and scores.tolist() == [0.0, 1.0]


def _one_rank_fails(policy: str) -> dict:
    import torch.distributed as dist

    fns = RewardFunctions(flaky, on_error=policy)
    texts = ["ok", "boom", "ok", "ok"] if dist.get_rank() == 1 else ["ok"] * 4
    batch, scores, info, _ = _scored_batch(texts, fns)
    metrics = {}
    try:
        check_reward_failures(fns, batch, scores, info, 5, None, metrics, group_estimator=True)
    except RewardError as exc:
        return {"error": str(exc)}
    return metrics


def _both_policies() -> list[dict]:
    return [_one_rank_fails("error"), _one_rank_fails("drop")]


def test_a_failure_on_one_rank_raises_on_both_and_counts_over_both():
    for error, dropped in run_distributed(_both_policies, 2, timeout=120):
        assert error["error"].startswith("step 5: 1 reward call(s) failed (0 timed out): reward function "
                                         "flaky failed on sample 1, uid 0, rank 1 (data source 'gsm8k'")
        assert dropped == {"reward/errors": 1.0, "reward/timeouts": 0.0, "reward/dropped_samples": 2.0}


def raises_on_rank_1(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """0.5 everywhere except on rank 1, where every third call raises."""
    CALLS[0] += 1
    if os.environ.get("RANK") == "1" and CALLS[0] % 3 == 0:
        raise KeyError("missing field")
    return 0.5


CALLS = [0]


def _grpo(model: str, data: str, root: str, policy: str) -> dict:
    from verl_trainer import Trainer
    from verl_trainer.algorithms import GRPO, PromptDataModule
    from verl_trainer.models.loading import load_tokenizer
    from verl_trainer.recipe_config import GRPORecipeConfig, load_config
    from verl_trainer.training.failure import RankFailedError, last_line

    CALLS[0] = 0
    cfg = load_config(GRPORecipeConfig, ROOT / "configs" / "grpo.yaml", [
        f"algorithm.model_path={model}", f"data.train_files={data}/train.jsonl", "data.val_files=null",
        "data.train_batch_size=4", "algorithm.rollout.n=2", "algorithm.rollout.max_new_tokens=3",
        "algorithm.actor.ppo_mini_batch_size=4", "algorithm.actor.engine.micro_batch_size_per_gpu=4",
        "algorithm.reward.name=tests.algorithms.test_reward_failures:raises_on_rank_1",
        f"algorithm.reward.on_error={policy}",
    ])
    trainer = Trainer(devices=2, max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, default_root_dir=root)
    try:
        trainer.fit(GRPO(cfg.algorithm), datamodule=PromptDataModule(cfg.data, load_tokenizer(model)))
    except RewardError as exc:
        return {"error": str(exc), "step": trainer.global_step}
    except RankFailedError as exc:  # the other rank's identical error may be reported first
        line = last_line(exc.traceback)
        assert line.startswith(f"{RewardError.__module__}.RewardError: "), exc.traceback
        return {"error": line, "step": trainer.global_step}
    return {"metrics": dict(trainer.callback_metrics), "step": trainer.global_step}


def _two_runs(model: str, data: str, root: str) -> list[dict]:
    return [_grpo(model, data, f"{root}/error", "error"), _grpo(model, data, f"{root}/drop", "drop")]


@pytest.mark.slow  # ~50 s: two GRPO fits at 2 ranks
def test_grpo_at_2_ranks_error_and_drop(tmp_path):
    from verl_trainer.data.tasks import ArithmeticTaskConfig, write_arithmetic_task
    from verl_trainer.models.tiny import make_tiny_model

    make_tiny_model(tmp_path / "model", hidden_size=32, num_attention_heads=4, num_key_value_heads=2, seed=1)
    task = ArithmeticTaskConfig(num_train=24, num_val=2, holdout_fraction=0.2)
    write_arithmetic_task(tmp_path / "data", task)
    for error, dropped in run_distributed(_two_runs, 2, str(tmp_path / "model"), str(tmp_path / "data"),
                                          str(tmp_path), timeout=400):
        assert error["step"] == 0, error
        assert "step 1: 1 reward call(s) failed" in error["error"] and "rank 1" in error["error"], error
        assert "KeyError: 'missing field'" in error["error"] and "data source 'arithmetic'" in error["error"]
        m = dropped["metrics"]
        assert dropped["step"] == 2 and m["reward/errors"] == 1.0 and m["reward/dropped_samples"] == 2.0
        assert m["reward/mean"] == 0.5 and math.isfinite(m["actor/pg_loss"])
        assert torch.isfinite(torch.tensor(m["actor/grad_norm"]))
