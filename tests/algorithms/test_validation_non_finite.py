"""Non-finite validation rewards are counted and follow ``algorithm.non_finite.policy``, as in training.

Before, a NaN reward in validation logged ``val/reward/mean=nan`` with no count or warning. A real GRPO
``Trainer.validate`` at 2 gloo ranks on the 4 validation prompts of the arithmetic task, with a reward that
is NaN for the even ``extra_info.index`` (prompts 0 and 2) and ``0.25 + index`` otherwise:

* ``drop_samples``: ``val/non_finite/rewards = 2`` (the count over the validation, not per batch or
  rank), ``val/non_finite/dropped_samples = 2``, and ``val/reward/mean`` over the finite prompts
  ((1.25 + 3.25) / 2), not NaN;
* ``error`` (the default): ``NonFiniteError`` on both ranks, naming the validation and the samples.
"""

from __future__ import annotations

import math

import pytest

from tests.algorithms.short_grpo import make_assets, short_grpo_config
from verl_trainer.testing import run_distributed


def nan_for_even_index(data_source, solution_str, ground_truth, extra_info=None) -> float:
    index = int(extra_info["index"])
    return math.nan if index % 2 == 0 else 0.25 + index


def _validate(model: str, data: str, root: str, policy: str) -> dict:
    from verl_trainer import Trainer
    from verl_trainer.algorithms import GRPO, PromptDataModule
    from verl_trainer.algorithms.non_finite import NonFiniteError
    from verl_trainer.models.loading import load_tokenizer
    from verl_trainer.training.failure import RankFailedError, last_line

    cfg = short_grpo_config(model, data, f"algorithm.non_finite.policy={policy}",
                            "algorithm.reward.name=tests.algorithms.test_validation_non_finite:nan_for_even_index")
    trainer = Trainer(devices=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      default_root_dir=root)
    try:
        [metrics] = trainer.validate(GRPO(cfg.algorithm), datamodule=PromptDataModule(cfg.data,
                                                                                       load_tokenizer(model)))
    except NonFiniteError as exc:
        return {"error": str(exc)}
    except RankFailedError as exc:  # the other rank's error, the same NonFiniteError
        return {"error": last_line(exc.traceback)}
    return {"metrics": dict(metrics)}


def _both(model: str, data: str, root: str) -> list[dict]:
    return [_validate(model, data, f"{root}/drop", "drop_samples"),
            _validate(model, data, f"{root}/error", "error")]


# ~14 s: two validations at 2 ranks (one spawn)
def test_nan_validation_rewards_are_counted_dropped_or_an_error_on_every_rank(tmp_path):
    make_assets(tmp_path)
    ranks = run_distributed(_both, 2, str(tmp_path / "model"), str(tmp_path / "data"), str(tmp_path),
                            timeout=300)
    for dropped, error in ranks:
        metrics = dropped["metrics"]
        assert metrics["val/non_finite/rewards"] == 2.0
        assert metrics["val/non_finite/dropped_samples"] == 2.0
        assert metrics["val/reward/mean"] == pytest.approx((1.25 + 3.25) / 2)
        assert "validation after step 0: 2 sample(s) with non-finite rewards" in error["error"]
        assert "algorithm.non_finite.policy=drop_samples" in error["error"]
