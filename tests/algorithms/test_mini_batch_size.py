"""``actor.ppo_mini_batch_size`` that does not divide ``data.train_batch_size`` fails before any model loads.

Both are prompts per step over all DP ranks. Before, ``ppo_mini_batch_size=3`` with a batch of 4 ran
silently with two mini-batches of 2 prompts. The recipe path is in
``tests/recipes/test_early_errors.py`` (``mini-batch-vs-batch``); here a ``Trainer.fit`` at 2 ranks: both
ranks raise the same error at the start of ``fit`` (the policy's ``model_path`` does not exist, so any
model load would fail differently).
"""

from __future__ import annotations

import pytest

from tests.algorithms.short_grpo import make_assets, short_grpo_config
from verl_trainer.algorithms.config import check_mini_batch_divides
from verl_trainer.testing import run_distributed

MESSAGE = ("algorithm.actor.ppo_mini_batch_size=3 does not divide data.train_batch_size=4 (both in prompts "
           "per step)")


def _fit(model: str, data: str, root: str) -> tuple[str, str]:
    from verl_trainer import Trainer
    from verl_trainer.algorithms import GRPO, PromptDataModule
    from verl_trainer.models.loading import load_tokenizer
    from verl_trainer.training.failure import RankFailedError, last_line

    cfg = short_grpo_config(f"{root}/no_such_model", data, "algorithm.actor.ppo_mini_batch_size=3",
                            "data.val_files=null")
    trainer = Trainer(devices=2, max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, default_root_dir=root)
    try:
        trainer.fit(GRPO(cfg.algorithm), datamodule=PromptDataModule(cfg.data, load_tokenizer(model)))
    except ValueError as exc:
        return "ValueError", str(exc)
    except RankFailedError as exc:  # the failure guard may name the other rank's error: the same one
        return "RankFailedError", last_line(exc.traceback)
    return "ran", ""


def test_fit_at_2_ranks_refuses_a_mini_batch_that_does_not_divide_the_batch(tmp_path):
    make_assets(tmp_path)
    ranks = run_distributed(_fit, 2, str(tmp_path / "model"), str(tmp_path / "data"), str(tmp_path / "run"),
                            timeout=120)
    for kind, message in ranks:
        assert kind in ("ValueError", "RankFailedError") and MESSAGE in message, (kind, message)
    assert any(kind == "ValueError" for kind, _ in ranks)
    assert not (tmp_path / "run" / "no_such_model").exists()


@pytest.mark.parametrize(("mini", "batch"), [(None, 4), (4, 4), (2, 4), (1, 4), (8, 4), (32, 4), (16, 64)])
def test_sizes_that_split_the_batch_evenly_or_keep_it_whole_pass(mini, batch):
    check_mini_batch_divides(mini, batch)


@pytest.mark.parametrize(("mini", "batch", "fits"),
                         [(3, 4, "1, 2, 4"), (32, 48, "1, 2, 3, 4, 6, 8, 12, 16, 24, 48")])
def test_a_mini_batch_that_does_not_divide_names_both_values_and_the_fix(mini, batch, fits):
    match = (rf"ppo_mini_batch_size={mini} does not divide data.train_batch_size={batch} .*a divisor of "
             rf"{batch} \({fits}; null: the whole batch\), or data.train_batch_size to a multiple of {mini}")
    with pytest.raises(ValueError, match=match):
        check_mini_batch_divides(mini, batch)
