"""A Lightning user's habits, run as they write them (issue 29 item 7): validation every epoch by default,
``fit(model, train, val)`` positionally and with Lightning's keywords, ``validate / test / predict(
dataloaders=)``, a misspelt ``EarlyStopping`` monitor failing at the first epoch's end instead of never
acting. The fits run in one gloo rank in a fresh process; the argument checks run here (nothing loads)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer.common import HookRecorder, SFTData, read_csv_metrics, sft_module, tiny_model
from verl_trainer import Trainer
from verl_trainer.algorithms.sft import SFT
from verl_trainer.callbacks import EarlyStopping, LearningRateMonitor
from verl_trainer.testing.ranks import run_distributed
from verl_trainer.training.lightning_compat import Loaders, fit_data, stage_data


def _quiet(root: Path, **kwargs) -> Trainer:
    kwargs = {"devices": 1, "logger": False, "enable_progress_bar": False, "enable_checkpointing": False,
              "default_root_dir": root, "seed": 5, **kwargs}
    return Trainer(**kwargs)


class LightningStyleSFT(SFT):
    """Logs and reads state as a LightningModule does."""

    seen: list

    def training_step(self, batch, batch_idx):
        self.log("custom/samples", float(batch.batch_size[0]), prog_bar=True, on_step=True, on_epoch=False,
                 sync_dist=True, reduce_fx="sum")
        t = self.trainer
        self.seen.append((self.global_step, self.current_epoch, str(self.device), t.current_epoch,
                          t.estimated_stepping_batches))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.log("custom/val_rows", float(batch.batch_size[0]), on_epoch=True, reduce_fx=torch.sum,
                 batch_size=4)
        return super().validation_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        return int(batch["attention_mask"].sum())


class EpochLoggingSFT(SFT):
    def training_step(self, batch, batch_idx):
        self.log("x", 1.0, on_epoch=True)
        return super().training_step(batch, batch_idx)


class LossReturningSFT(SFT):
    def training_step(self, batch, batch_idx):
        return torch.tensor(1.5, requires_grad=True)


def _habits(model_path: str, root: str) -> dict:
    root, out = Path(root), {}
    data = SFTData(n=8, batch_size=4, val=4)  # 2 steps per epoch
    train, val = data.train_dataloader(), data.val_dataloader()

    rec = HookRecorder()  # no val_check_interval, no check_val_every_n_epoch: Lightning validates every epoch
    t = _quiet(root / "positional", max_epochs=2, callbacks=[rec], logger="csv", enable_progress_bar=True)
    module = LightningStyleSFT(sft_module(model_path).config)
    module.seen = []
    t.fit(module, train, val)
    logged = read_csv_metrics(root / "positional")
    out["positional"] = {"val_runs": rec.calls.count("on_validation_epoch_end"),
                         "val_steps": sorted(s for s, row in logged.items() if "val/loss" in row)}
    out["seen"], out["bar"], out["log_dir"] = module.seen, t.progress_bar_callback.metrics, t.log_dir
    out["samples"], out["val_rows"] = logged[1]["custom/samples"], logged[2]["custom/val_rows"]
    out["validate"] = t.validate(module, dataloaders=val)
    out["test"] = t.test(module, dataloaders=val)
    out["predict"] = len(t.predict(module, dataloaders=val))

    rec = HookRecorder()  # opting out, as in Lightning: no per-epoch validation
    lr = LearningRateMonitor(logging_interval="epoch", log_momentum=True, log_weight_decay=True)
    _quiet(root / "opt_out", max_epochs=2, callbacks=[rec, lr], check_val_every_n_epoch=None,
           logger="csv").fit(sft_module(model_path), train_dataloaders=train, val_dataloaders=val)
    out["opt_out_val_runs"] = rec.calls.count("on_validation_epoch_end")
    out["lr"] = {step: {k: v for k, v in row.items() if k.startswith("lr/")}
                 for step, row in read_csv_metrics(root / "opt_out").items()}

    for name, cls in (("epoch_log", EpochLoggingSFT), ("loss", LossReturningSFT)):
        try:
            _quiet(root / name, max_steps=1).fit(cls(sft_module(model_path).config), train)
        except (ValueError, TypeError) as err:
            out[name] = str(err)

    t = _quiet(root / "typo", max_epochs=3, callbacks=[EarlyStopping(monitor="val/los")])
    try:
        t.fit(sft_module(model_path), train_dataloaders=train, val_dataloaders=val)
    except RuntimeError as err:
        out["typo"] = (str(err), t.global_step)
    return out


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return tiny_model(tmp_path_factory.mktemp("model"))


@pytest.mark.slow
def test_lightning_fit_habits(model_path, tmp_path):
    out = run_distributed(_habits, 1, model_path, str(tmp_path), timeout=600,
                          env={"WANDB_MODE": "offline"})[0]
    assert out["positional"] == {"val_runs": 2, "val_steps": [2, 4]}  # the end of each epoch
    assert out["validate"][0]["val/loss"] > 0 and out["validate"][0]["custom/val_rows"] == 4.0
    assert "test/loss" in out["test"][0]
    assert out["predict"] == 1  # one batch of 4
    assert out["opt_out_val_runs"] == 0
    # LearningRateMonitor(logging_interval="epoch"): once per epoch, with momentum and weight decay
    assert {s for s, row in out["lr"].items() if row} == {1, 3}, out["lr"]
    assert out["lr"][1] == {"lr/actor": 1e-3, "lr/actor/momentum": 0.9, "lr/actor/weight_decay": 0.0}
    # self.global_step / current_epoch / device and trainer.current_epoch / estimated_stepping_batches
    assert out["seen"] == [(0, 0, "cpu", 0, 4), (1, 0, "cpu", 0, 4), (2, 1, "cpu", 1, 4), (3, 1, "cpu", 1, 4)]
    assert "custom/samples" in out["bar"]  # prog_bar=True
    assert out["samples"] == 4.0 and out["val_rows"] == 4.0  # reduce_fx="sum" / torch.sum
    assert out["log_dir"].startswith(str(tmp_path / "positional" / "lightning_logs" / "version_"))
    assert "on_epoch=True): values logged in training_step (per step) are logged with on_step=True" \
        in out["epoch_log"]
    assert "training_step/validation_step returned a tensor (Lightning's loss)" in out["loss"]
    message, step = out["typo"]
    assert "EarlyStopping(monitor='val/los') found no such metric; available:" in message
    assert "val/loss" in message and step == 2  # at the first epoch's end, not never


def test_fit_data_arguments_follow_lightning():
    data = SFTData(n=8, batch_size=4, val=4)
    train, val = data.train_dataloader(), data.val_dataloader()
    assert fit_data(data, None, None) is data  # fit(model, datamodule) positionally
    assert fit_data(None, None, data) is data
    assert fit_data(train, None, None) is train
    both = fit_data(train, val, None)
    assert isinstance(both, Loaders) and both.train_dataloader() is train and both.val_dataloader() is val
    assert stage_data("test", val, None) is val and stage_data("test", None, data) is data


def test_conflicting_data_arguments_are_refused_before_anything_runs(model_path, tmp_path):
    data = SFTData(n=8, batch_size=4, val=4)
    t = _quiet(tmp_path, max_steps=1)
    module = sft_module(model_path)
    with pytest.raises(ValueError, match="fit got a datamodule and train_dataloaders / val_dataloaders"):
        t.fit(module, data.train_dataloader(), datamodule=data)
    with pytest.raises(ValueError, match="fit got val_dataloaders but no training data"):
        t.fit(module, val_dataloaders=data.val_dataloader())
    with pytest.raises(ValueError, match="validate got dataloaders and a datamodule; pass one of them"):
        t.validate(module, data.val_dataloader(), datamodule=data)
    with pytest.raises(ValueError, match=r"return_predictions=False\): the predictions are always returned"):
        t.predict(module, data.val_dataloader(), return_predictions=False)


def test_lightning_module_methods_that_would_be_ignored_are_refused(model_path, tmp_path):
    class WithOptimizers(SFT):
        def configure_optimizers(self):
            return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)

        def on_train_epoch_start(self):
            pass

    with pytest.raises(TypeError, match=r"(?s)configure_optimizers\(\): not called here.*OptimConfig"
                                        r".*on_train_epoch_start: hooks are called on callbacks here"):
        _quiet(tmp_path, max_steps=1).fit(WithOptimizers(sft_module(model_path).config), SFTData())


def test_lightning_trainer_attributes_before_fit(model_path, tmp_path):
    t = _quiet(tmp_path, max_steps=7)
    assert (t.current_epoch, t.estimated_stepping_batches, t.log_dir) == (0, 7, str(tmp_path))
    with pytest.raises(RuntimeError, match="with max_epochs alone is known once fit has the training data"):
        _ = _quiet(tmp_path, max_epochs=2).estimated_stepping_batches
    module = sft_module(model_path)
    assert (module.global_step, module.current_epoch, module.device) == (0, 0, torch.device("cpu"))


def test_lightning_callback_refusals_name_the_arguments_ours_take():
    from lightning.pytorch.callbacks import LearningRateMonitor as LightningLRMonitor
    from lightning.pytorch.callbacks import ModelCheckpoint as LightningCheckpoint

    takes = r"LearningRateMonitor, which takes prefix, logging_interval, log_momentum, log_weight_decay"
    with pytest.raises(TypeError, match=takes + r" \(all of Lightning's\)"):
        Trainer(callbacks=[LightningLRMonitor(logging_interval="step")])
    ours = "ModelCheckpoint, which takes dirpath, every_n_train_steps, .*monitor, mode, save_top_k.*; "
    with pytest.raises(TypeError, match=ours + "Lightning's verbose, .* are not among them"):
        Trainer(callbacks=[LightningCheckpoint(monitor="val/loss")])
    with pytest.raises(ValueError, match="logging_interval='batch'.*choose one of"):
        LearningRateMonitor(logging_interval="batch")
