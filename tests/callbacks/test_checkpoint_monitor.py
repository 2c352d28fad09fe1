"""ModelCheckpoint with Lightning's arguments (issue 29 item 8): keep the best by a validation metric
(``monitor``, ``mode``, ``save_top_k``) besides the newest, save every N epochs, resume the ranking; the
arguments it cannot honour are refused with the fix. The fits run in one gloo rank in a fresh process."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.common import SFTData, sft_module, tiny_model
from verl_trainer import Trainer
from verl_trainer.algorithms.sft import SFT
from verl_trainer.callbacks import ModelCheckpoint
from verl_trainer.testing.ranks import run_distributed

SCORES = [5.0, 9.0, 1.0, 7.0]  # the validation metric at the end of epochs 0..3


class ScoredSFT(SFT):
    def validation_step(self, batch, batch_idx):
        self.log("custom/score", SCORES[self.current_epoch])
        return super().validation_step(batch, batch_idx)


def _fit(model_path: str, root: str, epochs: int, ckpt_path: str | None = None, monitor: str = "custom/score"
         ) -> dict:
    ckpt = ModelCheckpoint(monitor=monitor, mode="max", save_top_k=1, every_n_epochs=1)
    trainer = Trainer(devices=1, max_epochs=epochs, logger=False, enable_progress_bar=False,
                      default_root_dir=root, seed=5, callbacks=[ckpt])
    try:
        trainer.fit(ScoredSFT(sft_module(model_path).config), SFTData(n=8, batch_size=4, val=4),
                    ckpt_path=ckpt_path)
    except RuntimeError as err:
        return {"error": str(err), "step": trainer.global_step}
    return {"dirs": sorted(p.name for p in (Path(root) / "checkpoints").glob("step_*")),
            "best": ckpt.best_model_path, "score": ckpt.best_model_score}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return tiny_model(tmp_path_factory.mktemp("model"))


@pytest.mark.slow
def test_the_best_checkpoint_by_a_validation_metric_is_kept_across_a_resume(model_path, tmp_path):
    root = str(tmp_path / "run")
    first = run_distributed(_fit, 1, model_path, root, 3, timeout=600, env={"WANDB_MODE": "offline"})[0]
    # 2 steps per epoch, a save at each epoch's end: epoch 1 (step 4, score 9) is the best, step 6 the newest
    assert first["dirs"] == ["step_000004", "step_000006"], first
    assert first["best"] == str(Path(root) / "checkpoints" / "step_000004") and first["score"] == 9.0
    resumed = run_distributed(_fit, 1, model_path, root, 4, "last", timeout=600,
                              env={"WANDB_MODE": "offline"})[0]
    assert resumed["dirs"] == ["step_000004", "step_000008"] and resumed["score"] == 9.0, resumed
    typo = run_distributed(_fit, 1, model_path, str(tmp_path / "typo"), 2, None, "custom/scor", timeout=600,
                           env={"WANDB_MODE": "offline"})[0]
    assert "ModelCheckpoint(monitor='custom/scor') found no such metric at step 2" in typo["error"]
    assert "custom/score" in typo["error"]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"filename": "{epoch}-{val_loss:.2f}"}, "checkpoints are directories named step_<N>"),
    ({"monitor": "val/loss", "save_last": False}, "the newest checkpoint is always kept"),
    ({"save_top_k": 0}, "0 saves nothing: use Trainer\\(enable_checkpointing=False\\)"),
    ({"mode": "best"}, "mode='best'\\); choose one of"),
    ({"every_n_epochs": 0}, "every_n_epochs must be None or >= 1"),
])
def test_what_it_cannot_honour_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelCheckpoint(**kwargs)


def test_lightning_defaults_map_onto_ours():
    assert ModelCheckpoint(save_top_k=3).keep_last_k == 3  # no monitor: Lightning keeps the newest k
    assert ModelCheckpoint(save_top_k=-1).keep_last_k is None
    ckpt = ModelCheckpoint(monitor="val/loss", save_last=True)
    assert (ckpt.save_top_k, ckpt.keep_last_k) == (1, 1)
    assert (ckpt.best_model_path, ckpt.best_model_score) == ("", None)
