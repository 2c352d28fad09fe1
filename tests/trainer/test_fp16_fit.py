"""Trainer(precision="16-mixed") in a real SFT fit (one gloo rank, fresh process): the loss follows float32,
the loss scale is logged, and an overflow at torch's initial scale (2**16) is a reported skip, not an
error under the default non-finite policy."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from tests.trainer.common import SFTData, read_csv_metrics, sft_module, tiny_model
from verl_trainer import Trainer
from verl_trainer.testing.ranks import run_distributed


def _fit(model_path: str, root: str) -> dict:
    out = {}
    for precision in ("32-true", "16-mixed"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # float16 emulated on this CPU
            t = Trainer(devices=1, max_steps=4, precision=precision, logger="csv", enable_progress_bar=False,
                        enable_checkpointing=False, default_root_dir=Path(root) / precision, seed=5)
        t.fit(sft_module(model_path, micro_batch_size=2, lr=1e-3), SFTData(n=16, batch_size=4))
        out[precision] = read_csv_metrics(Path(root) / precision)
    return out


def test_fp16_mixed_sft_fit(tmp_path):
    model = tiny_model(tmp_path / "model")
    out = run_distributed(_fit, 1, str(model), str(tmp_path), timeout=600, env={"WANDB_MODE": "offline"})[0]
    fp32, fp16 = out["32-true"], out["16-mixed"]
    assert fp16[1]["sft/loss"] == pytest.approx(fp32[1]["sft/loss"], rel=5e-3)  # same weights at step 1
    scales = [fp16[s]["train/loss_scale"] for s in sorted(fp16)]
    skipped = [fp16[s]["train/update_skipped"] for s in sorted(fp16)]
    assert "train/loss_scale" not in fp32[1] and len(scales) == 4
    # each skipped step halved the scale; an applied one kept it (growth needs 2000 clean steps)
    previous = 65536.0
    for scale, skip in zip(scales, skipped):
        assert scale == (previous / 2 if skip else previous)
        previous = scale
    assert 0.0 in skipped  # it trains
