"""One-rank fits of a real SFT module (in a fresh process whose world the Trainer joins): the pinned hook
order, callback chaining and state, metric logging, checkpoint retention, resume and validate."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import yaml

from tests.trainer.common import HookRecorder, SFTData, read_csv_metrics, sft_module, tiny_model
from verl_trainer import Trainer
from verl_trainer.callbacks import Callback, LearningRateMonitor, ModelCheckpoint, ThroughputMonitor
from verl_trainer.testing.ranks import run_distributed

STEP = [
    "on_train_batch_start",
    "on_before_update",
    "on_before_zero_grad",
    "on_micro_batches",
    "on_before_backward",  # one per micro-batch (2 samples after Halve, micro-batch size 1)
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",
]
VALIDATION = ["on_validation_start", "on_validation_epoch_start"] + [
    "on_validation_batch_start", "on_validation_batch_end"
] * 2 + ["on_validation_epoch_end", "on_validation_end"]
FIT_2_STEPS = (
    ["setup", "on_fit_start", "on_train_start", "on_train_epoch_start"]
    + STEP + ["on_save_checkpoint"]                    # step 1: ModelCheckpoint saves in on_train_batch_end
    + STEP + VALIDATION + ["on_save_checkpoint"]       # step 2: validation first, then the save
    + ["on_train_epoch_end", "on_train_end", "on_fit_end", "teardown"]  # step 2 is saved: no save at the end
)
RESUME_1_STEP = (
    ["setup", "on_load_checkpoint", "on_fit_start", "on_train_start", "on_train_epoch_start"]
    + STEP + ["on_save_checkpoint"]
    + ["on_train_epoch_end", "on_train_end", "on_fit_end", "teardown"]
)


class Halve(Callback):
    """on_before_update returning a new batch: keeps the first half."""

    def on_before_update(self, trainer, module, batch):
        return batch[: batch.batch_size[0] // 2]


class Spy(Callback):
    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_before_update(self, trainer, module, batch):
        self.sizes.append(batch.batch_size[0])


class Counter(Callback):
    def __init__(self) -> None:
        self.count = 0
        self.loaded: dict | None = None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.count += 1

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state_dict):
        self.loaded = dict(state_dict)
        self.count = state_dict["count"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return tiny_model(tmp_path_factory.mktemp("model"))


def _trainer(root: Path, max_steps: int, *callbacks: Callback) -> Trainer:
    return Trainer(
        strategy="fsdp2", devices=1, max_steps=max_steps, default_root_dir=root, logger="csv",
        val_check_interval=2, seed=11,
        callbacks=[*callbacks, LearningRateMonitor(), ThroughputMonitor(),
                   ModelCheckpoint(every_n_train_steps=1, keep_last_k=1)],
    )


def _fit_validate_resume(model_path: str, root: str) -> dict:
    """Runs in a fresh process (a 1-rank world made by the harness, which the Trainer joins)."""
    root = Path(root)
    data = SFTData(n=16, batch_size=4, val=8)
    rec, spy, counter = HookRecorder(), Spy(), Counter()
    trainer = _trainer(root, 2, Halve(), spy, counter, rec)
    trainer.fit(sft_module(model_path, micro_batch_size=1), data)
    first = {"calls": rec.calls, "sizes": spy.sizes, "step": trainer.global_step, "dp_size": trainer.dp_size,
             "has_dp_group": trainer.dp_group is not None, "metrics": dict(trainer.callback_metrics),
             "ckpts": sorted(p.name for p in (root / "checkpoints").iterdir())}

    rec2, counter2 = HookRecorder(), Counter()
    resumed = _trainer(root, 3, Halve(), counter2, rec2)
    module2 = sft_module(model_path, micro_batch_size=1)
    resumed.fit(module2, data, ckpt_path="last")
    second = {"calls": rec2.calls, "loaded": counter2.loaded, "count": counter2.count,
              "step": resumed.global_step, "ckpts": sorted(p.name for p in (root / "checkpoints").iterdir())}

    validated = Trainer(devices=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        default_root_dir=root).validate(module2, data)

    fresh = Trainer(devices=1, max_steps=1, default_root_dir=root / "fresh", logger=False,
                    enable_progress_bar=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh.fit(sft_module(model_path), SFTData(n=8, batch_size=4), ckpt_path="last")
    try:
        Trainer(devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                default_root_dir=root / "fresh").fit(sft_module(model_path), SFTData(n=8, batch_size=4),
                                                     ckpt_path=root / "nope")
        missing_error = None
    except FileNotFoundError as e:
        missing_error = str(e)
    return {"first": first, "second": second, "validated": validated, "fresh_step": fresh.global_step,
            "warnings": [str(w.message) for w in caught], "missing_error": missing_error}


def test_fit_hook_order_state_metrics_and_resume(model_path, tmp_path):
    result = run_distributed(_fit_validate_resume, 1, model_path, str(tmp_path), timeout=400,
                             env={"WANDB_MODE": "offline"})[0]
    first, second = result["first"], result["second"]
    assert first["calls"] == FIT_2_STEPS
    assert first["sizes"] == [2, 2]  # the chained hook saw the batch the first callback returned
    assert first["step"] == 2 and first["dp_size"] == 1 and first["has_dp_group"]
    for name in ("sft/loss", "train/grad_norm", "train/lr", "val/loss", "lr/actor", "perf/tokens_per_sec",
                 "perf/samples_per_sec", "perf/tflops_per_sec"):
        assert name in first["metrics"], name
    assert first["ckpts"] == ["step_000002"]  # keep_last_k=1, no temporary directory left
    logged = read_csv_metrics(tmp_path / "lightning_logs" / "version_0")
    assert sorted(logged) == [1, 2] and "val/loss" in logged[2] and "sft/loss" in logged[1]
    hparams = yaml.safe_load((tmp_path / "lightning_logs" / "version_0" / "hparams.yaml").read_text())
    assert hparams["model_path"] == model_path

    assert second["calls"] == RESUME_1_STEP
    assert second["loaded"] == {"count": 2} and second["count"] == 3 and second["step"] == 3
    assert second["ckpts"] == ["step_000003"]
    assert sorted(read_csv_metrics(tmp_path / "lightning_logs" / "version_1")) == [3]

    assert list(result["validated"][0]) == ["val/loss"] and result["validated"][0]["val/loss"] > 0
    assert result["fresh_step"] == 1
    assert any("found no complete checkpoint" in w for w in result["warnings"])
    assert "not a complete checkpoint" in result["missing_error"]


def test_unknown_hook_is_an_error():
    with pytest.raises(ValueError, match="unknown hook 'on_foo'"):
        Trainer(max_steps=1).call_hook("on_foo")
