"""RayTrainReport refuses, on every rank and before a step, a Trainer without checkpoints or a process outside
Ray Train (its work inside Ray: tests/recipes/test_ray.py). Marker ``ray``: needs the ``ray`` extra."""

from __future__ import annotations

import pytest

from tests.trainer.common import SFTData, sft_module, tiny_model
from verl_trainer.testing.ranks import run_distributed

pytestmark = pytest.mark.ray


def _refusal(model_path: str, root: str, checkpointing: bool) -> str:
    """The error ``fit`` raised on this rank (its own, or the other rank's carried by RankFailedError)."""
    from verl_trainer import Trainer
    from verl_trainer.callbacks import RayTrainReport

    trainer = Trainer(devices=2, max_steps=1, default_root_dir=root, logger=False, enable_progress_bar=False,
                      enable_checkpointing=checkpointing, callbacks=[RayTrainReport()])
    try:
        trainer.fit(sft_module(model_path), SFTData(n=8, batch_size=4))
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return f"{type(exc).__name__}: {exc} | step {trainer.global_step}"
    return "no error"


@pytest.mark.parametrize(("checkpointing", "expected"), [
    (False, "this Trainer has none (enable_checkpointing=False); turn checkpointing on (recipes: "
            "trainer.enable_checkpointing=true"),
    (True, "works inside a Ray Train worker (the train_loop_per_worker of ray.train.torch.TorchTrainer), and "
           "this process is not one; run it through a TorchTrainer (examples/ray_grpo.py)"),
])
def test_refuses_without_checkpoints_or_outside_ray_train(tmp_path, checkpointing, expected):
    model_path = tiny_model(tmp_path / "model")
    errors = run_distributed(_refusal, 2, model_path, str(tmp_path / "run"), checkpointing, timeout=300,
                             env={"WANDB_MODE": "offline"})
    for error in errors:  # every rank ends with the message, before a step
        assert expected in error and error.endswith("step 0"), errors
