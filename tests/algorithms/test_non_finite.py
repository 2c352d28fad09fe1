"""Non-finite rewards, advantages and losses (``algorithms/non_finite.py``).

Unit (default run): the guard on one process (naming, group drops, the skipped-steps limit, config
errors). ``slow``: GRPO at 2 ranks with a reward that is NaN for every third sample each rank scores:
``policy=error`` stops step 1 on both ranks with the samples named; ``drop_samples`` trains on the rest
(finite loss, update not skipped, the counts logged); a reward that is always NaN stops the run after
``max_consecutive_skipped_steps``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from verl_trainer.algorithms.non_finite import NonFiniteConfig, NonFiniteError
from verl_trainer.algorithms.stages.guard import NonFiniteGuard
from verl_trainer.data import schema
from verl_trainer.data.packing import make_batch
from verl_trainer.data.tasks import ArithmeticTaskConfig, write_arithmetic_task
from verl_trainer.models.tiny import make_tiny_model
from verl_trainer.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]


def _batch() -> object:
    return make_batch([[4, 5]] * 4, [[6], [6, 7], [6], [6, 7, 8]], uids=[0, 0, 1, 1])


def test_error_policy_names_the_samples():
    guard = NonFiniteGuard(NonFiniteConfig(), group_estimator=True)
    want = r"step 7: 1 sample\(s\) with non-finite rewards \(uid 1 on rank 0: inf"
    with pytest.raises(NonFiniteError, match=want):
        guard.check_samples(_batch(), torch.tensor([0.0, 1.0, math.inf, 0.5]), "rewards", 7, None, {})


def test_drop_policy_drops_the_whole_group_and_counts():
    guard = NonFiniteGuard(NonFiniteConfig(policy="drop_samples"), group_estimator=True)
    batch, metrics = _batch(), {}
    dropped = guard.check_samples(batch, torch.tensor([0.0, math.nan, 1.0, 0.5]), "rewards", 1, None, metrics)
    assert dropped.tolist() == [True, True, False, False]
    assert schema.real_mask(batch).tolist() == [False, False, True, True]
    assert batch[schema.RESPONSE_MASK][:2].sum() == 0 and batch[schema.RESPONSE_MASK][2:].sum() > 0
    assert metrics == {"non_finite/rewards": 1.0, "non_finite/dropped_samples": 2.0}
    # padding samples are not checked again (their advantages may be anything)
    adv = torch.full(batch[schema.RESPONSE_MASK].shape, math.nan)
    adv[2:] = 0.0
    assert not guard.check_samples(batch, adv, "advantages", 1, None, metrics).any()


def test_validation_counts_with_a_sum_and_drops_whole_prompts_without_touching_training_counters():
    from verl_trainer.metrics.metric import Reduction

    guard = NonFiniteGuard(NonFiniteConfig(policy="drop_samples"), group_estimator=False)
    batch, metrics, scores = _batch(), {}, torch.tensor([0.0, math.nan, 1.0, 0.5])
    dropped = guard.check_validation(batch, scores, 3, None, metrics)
    assert dropped.tolist() == [True, True, False, False]  # the prompt's every response: @k stays defined
    assert scores.tolist() == [0.0, 0.0, 1.0, 0.5] and guard.dropped == 0
    counted = metrics["val/non_finite/rewards"]
    assert counted.reduction == Reduction.SUM and float(counted.aggregate()) == 1.0  # summed over batches
    assert float(metrics["val/non_finite/dropped_samples"].aggregate()) == 2.0
    strict = NonFiniteGuard(NonFiniteConfig(), False)
    want = r"validation after step 3: 1 sample\(s\) with non-finite rewards \(uid 0 on rank 0: nan\)"
    with pytest.raises(NonFiniteError, match=want):
        strict.check_validation(_batch(), torch.tensor([math.nan, 1.0, 1.0, 1.0]), 3, None, {})


def test_token_values_are_checked_under_the_response_mask():
    guard = NonFiniteGuard(NonFiniteConfig(), group_estimator=False)
    batch = _batch()
    adv = torch.zeros(batch[schema.RESPONSE_MASK].shape)
    adv[~batch[schema.RESPONSE_MASK].bool()] = math.nan  # outside the response: ignored
    assert not guard.check_samples(batch, adv, "advantages", 1, None, {}).any()


def test_skipped_steps_limit_and_loss_errors():
    guard = NonFiniteGuard(NonFiniteConfig(policy="drop_samples", max_consecutive_skipped_steps=2), False)
    guard.end_step(True, 1)
    guard.end_step(False, 2)  # a trained step resets the count
    guard.end_step(True, 3)
    guard.end_step(True, 4)
    with pytest.raises(NonFiniteError, match="3 steps in a row.*max_consecutive_skipped_steps=2"):
        guard.end_step(True, 5)
    assert guard.check_update("actor", math.nan, [], 5) is True
    strict = NonFiniteGuard(NonFiniteConfig(), False)
    assert strict.check_update("actor", 1.5, [], 1) is False
    with pytest.raises(NonFiniteError, match=r"step 2: actor grad norm is nan.*actor/pg_loss=nan"):
        strict.check_update("actor", math.nan, [{"actor/pg_loss": torch.tensor(math.nan)}], 2)


def test_config_errors_name_the_key_and_choices():
    with pytest.raises(ValueError, match=r"algorithm.non_finite.policy='skip'.*\('error', 'drop_samples'\)"):
        NonFiniteConfig(policy="skip")
    with pytest.raises(ValueError, match="max_consecutive_skipped_steps=-1"):
        NonFiniteConfig(max_consecutive_skipped_steps=-1)


CALLS = [0]


def every_third_nan(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """NaN for every third sample this process scores, 0.5 otherwise."""
    CALLS[0] += 1
    return math.nan if CALLS[0] % 3 == 0 else 0.5


def always_nan(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return math.nan


def _grpo(model: str, data: str, root: str, reward: str, policy: str, max_steps: int) -> dict:
    from verl_trainer import Trainer
    from verl_trainer.algorithms import GRPO, PromptDataModule
    from verl_trainer.models.loading import load_tokenizer
    from verl_trainer.recipe_config import GRPORecipeConfig, load_config
    from verl_trainer.training.failure import RankFailedError, last_line

    cfg = load_config(GRPORecipeConfig, ROOT / "configs" / "grpo.yaml", [
        f"algorithm.model_path={model}", f"data.train_files={data}/train.jsonl", "data.val_files=null",
        "data.train_batch_size=4", "algorithm.rollout.n=2", "algorithm.rollout.max_new_tokens=3",
        "algorithm.actor.ppo_mini_batch_size=4", "algorithm.actor.engine.micro_batch_size_per_gpu=4",
        f"algorithm.reward.name=tests.algorithms.test_non_finite:{reward}",
        f"algorithm.non_finite.policy={policy}", "algorithm.non_finite.max_consecutive_skipped_steps=1",
    ])
    trainer = Trainer(devices=2, max_steps=max_steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, default_root_dir=root)
    try:
        trainer.fit(GRPO(cfg.algorithm), datamodule=PromptDataModule(cfg.data, load_tokenizer(model)))
    except NonFiniteError as exc:
        return {"error": str(exc), "step": trainer.global_step}
    except RankFailedError as exc:
        # every rank raises the same error together; the failure guard may report the other rank's first,
        # whose last traceback line is the same NonFiniteError
        line = last_line(exc.traceback)
        assert line.startswith(f"{NonFiniteError.__module__}.NonFiniteError: "), exc.traceback
        return {"error": line, "step": trainer.global_step}
    return {"metrics": dict(trainer.callback_metrics), "step": trainer.global_step}


def _three_runs(model: str, data: str, root: str) -> list[dict]:
    CALLS[0] = 0
    error = _grpo(model, data, f"{root}/error", "every_third_nan", "error", 2)
    CALLS[0] = 0
    dropped = _grpo(model, data, f"{root}/drop", "every_third_nan", "drop_samples", 2)
    stopped = _grpo(model, data, f"{root}/stop", "always_nan", "drop_samples", 4)
    return [error, dropped, stopped]


@pytest.mark.slow  # ~60 s: three GRPO fits at 2 ranks
def test_grpo_at_2_ranks_error_drop_and_stop(tmp_path):
    make_tiny_model(tmp_path / "model", hidden_size=32, num_attention_heads=4, num_key_value_heads=2, seed=1)
    task = ArithmeticTaskConfig(num_train=24, num_val=2, holdout_fraction=0.2)
    write_arithmetic_task(tmp_path / "data", task)
    ranks = run_distributed(_three_runs, 2, str(tmp_path / "model"), str(tmp_path / "data"), str(tmp_path),
                            timeout=400)
    for error, dropped, stopped in ranks:
        # error (default policy): step 1 stops on every rank, naming a sample of each rank
        assert error["step"] == 0, error
        assert "step 1: 2 sample(s) with non-finite rewards" in error["error"], error
        assert "on rank 0: nan" in error["error"] and "on rank 1: nan" in error["error"]
        assert "algorithm.non_finite.policy=drop_samples" in error["error"]
        # drop_samples: one NaN per rank per step, its group of 2 dropped; the rest trains
        m = dropped["metrics"]
        assert dropped["step"] == 2 and "error" not in dropped
        assert m["non_finite/rewards"] == 2.0 and m["non_finite/dropped_samples"] == 4.0
        assert m["actor/update_skipped"] == 0.0
        assert math.isfinite(m["actor/pg_loss"]) and math.isfinite(m["actor/grad_norm"])
        assert m["reward/mean"] == 0.5  # the dropped samples count in no metric
        # always NaN: every step drops everything; the 2nd skipped step in a row exceeds the limit of 1
        assert stopped["step"] == 1, stopped
        assert "2 steps in a row skipped their update" in stopped["error"], stopped
