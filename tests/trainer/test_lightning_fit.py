"""Lightning's Trainer surface in real fits (one gloo rank in a fresh process): accumulate_grad_batches equals
one larger batch exactly, limits / fractional validation / sanity check / epoch hooks, EarlyStopping,
self.log, test / predict, HF-style dict batches, gradient_clip_val, fast_dev_run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from tests.trainer.common import HookRecorder, SFTData, read_csv_metrics, sft_module, tiny_model
from verl_trainer import Trainer
from verl_trainer.algorithms.sft import SFT
from verl_trainer.callbacks import EarlyStopping
from verl_trainer.data.sft import SFTDataset
from verl_trainer.testing.ranks import run_distributed


def _quiet(root: Path, **kwargs) -> Trainer:
    kwargs = {"devices": 1, "logger": False, "enable_progress_bar": False, "enable_checkpointing": False,
              "default_root_dir": root, "seed": 5, **kwargs}
    return Trainer(**kwargs)


class CountingSFT(SFT):
    """SFT that logs with self.log: the samples of each step (sum) and a constant (mean)."""

    def training_step(self, batch, batch_idx):
        self.log("custom/samples", float(batch.batch_size[0]), reduce="sum")
        self.log("custom/seven", 7.0)
        return super().training_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        return int(batch["attention_mask"].sum())


def hf_collate(items):
    """What an HF collator yields: left-padded input_ids, attention_mask, labels with -100 on the prompt."""
    width = max(len(p) + len(r) for p, r in items)
    ids = torch.zeros(len(items), width, dtype=torch.long)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for i, (p, r) in enumerate(items):
        row = torch.tensor(p + r)
        ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
        labels[i, width - len(r):] = torch.tensor(r)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


MODULE_KWARGS = {"micro_batch_size": 2, "lr": 1e-2}


def _accumulate(model_path: str, root: str) -> dict:
    """accumulate_grad_batches=2 of batch 2 == one batch of 4 (same samples: same sampler order)."""
    root, out = Path(root), {}
    for name, bs, acc in (("acc", 2, 2), ("big", 4, 1)):
        t = _quiet(root / name, max_steps=2, accumulate_grad_batches=acc, logger="csv")
        m = sft_module(model_path, **MODULE_KWARGS)
        t.fit(m, SFTData(n=16, batch_size=bs))
        out[name] = {"metrics": read_csv_metrics(root / name), "step": t.global_step,
                     "weights": [p.detach().clone() for p in m.actor.module.parameters()]}
    return out


def _fits(model_path: str, root: str) -> dict:
    root, out = Path(root), {}
    module_kwargs = MODULE_KWARGS

    # limits, fractional validation, sanity check, epoch hooks, self.log, gradient_clip_val
    rec = HookRecorder()
    t = _quiet(root / "limits", max_epochs=2, limit_train_batches=4, limit_val_batches=1,
               val_check_interval=0.5,
               num_sanity_val_steps=1, gradient_clip_val=0.25, callbacks=[rec], logger="csv")
    m = CountingSFT(sft_module(model_path, **module_kwargs).config)
    t.fit(m, SFTData(n=16, batch_size=4, val=8))
    out["limits"] = {"calls": rec.calls, "step": t.global_step, "clip": m.actor.optim_config.clip_grad,
                     "metrics": dict(t.callback_metrics), "logged": read_csv_metrics(root / "limits")}
    out["test"] = t.test(m, SFTData(n=16, batch_size=4, val=8).val_dataloader())
    out["predict"] = t.predict(m, DataLoader(SFTDataset([([5, 6], [7])] * 3), batch_size=2,
                                             collate_fn=SFTData().train.collate))

    # EarlyStopping on an increasing metric stops after patience checks, min_steps delays it
    class Rising(SFT):
        def training_step(self, batch, batch_idx):
            self.log("rising", float(self.trainer.global_step))
            return super().training_step(batch, batch_idx)

    t = _quiet(root / "es", max_steps=20, min_steps=4,
               callbacks=[EarlyStopping(monitor="rising", patience=1, check_on_train_epoch_end=True)],
               limit_train_batches=1)
    t.fit(Rising(sft_module(model_path, **module_kwargs).config), SFTData(n=8, batch_size=4))
    out["es_step"] = t.global_step

    # HF dict batches (left padded, -100 labels) train like the schema batches of the same samples
    for name, collate in (("hf", hf_collate), ("schema", SFTData().train.collate)):
        data = SFTData(n=8, batch_size=4)
        loader = DataLoader(data.train, batch_size=4, collate_fn=collate)
        t = _quiet(root / name, max_steps=1, logger="csv")
        t.fit(sft_module(model_path, **module_kwargs), loader)
        out[name] = read_csv_metrics(root / name)[1]["sft/loss"]
    try:
        _quiet(root / "bad", max_steps=1).fit(
            sft_module(model_path), DataLoader([{"text": "hi"}] * 4, batch_size=2))
    except ValueError as e:
        out["bad"] = str(e)

    fast = _quiet(root / "fast", fast_dev_run=2, max_steps=50)
    fast.fit(sft_module(model_path, **module_kwargs), SFTData(n=16, batch_size=4, val=8))
    out["fast"] = {"step": fast.global_step, "val": "val/loss" in fast.callback_metrics}
    return out


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return tiny_model(tmp_path_factory.mktemp("model"))


def test_accumulate_grad_batches_equals_one_larger_batch(model_path, tmp_path):
    out = run_distributed(_accumulate, 1, model_path, str(tmp_path), timeout=400,
                          env={"WANDB_MODE": "offline"})[0]
    acc, big = out["acc"], out["big"]
    assert acc["step"] == big["step"] == 2
    for step in (1, 2):
        assert acc["metrics"][step]["sft/loss"] == pytest.approx(big["metrics"][step]["sft/loss"], rel=1e-5)
        assert acc["metrics"][step]["train/grad_norm"] == pytest.approx(
            big["metrics"][step]["train/grad_norm"], rel=1e-4)
    for a, b in zip(acc["weights"], big["weights"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_lightning_trainer_surface_in_fits(model_path, tmp_path):
    out = run_distributed(_fits, 1, model_path, str(tmp_path), timeout=600, env={"WANDB_MODE": "offline"})[0]
    lim = out["limits"]
    calls = lim["calls"]
    assert lim["step"] == 8  # 2 epochs x limit_train_batches=4
    assert calls.count("on_train_epoch_start") == calls.count("on_train_epoch_end") == 2
    assert calls.count("on_sanity_check_start") == calls.count("on_sanity_check_end") == 1
    first_train = calls.index("on_train_start")
    assert calls.index("on_sanity_check_end") < first_train < calls.index("on_train_epoch_start")
    # val_check_interval=0.5 of 4 batches: after batches 2 and 4 -> 2 per epoch (+ the sanity check)
    assert calls.count("on_validation_epoch_end") == 2 * 2 + 1
    assert calls.count("on_validation_batch_start") == 5  # limit_val_batches=1
    assert calls.count("on_before_zero_grad") == 8
    assert lim["clip"] == 0.25
    assert lim["metrics"]["custom/samples"] == 4.0 and lim["metrics"]["custom/seven"] == 7.0
    val_steps = sorted(step for step, row in lim["logged"].items() if "val/loss" in row)
    assert 0 not in lim["logged"] and val_steps == [2, 4, 6, 8]  # the sanity check logs nothing
    assert list(out["test"][0]) == ["test/loss"] and out["test"][0]["test/loss"] > 0
    assert out["predict"] == [6, 3]

    assert out["es_step"] == 4  # stops at the first check after min_steps (rising metric, patience 1)
    assert out["hf"] == pytest.approx(out["schema"], rel=1e-6)
    assert "a dict batch needs 'input_ids'" in out["bad"] and "'text'" in out["bad"]
    assert out["fast"] == {"step": 2, "val": True}
