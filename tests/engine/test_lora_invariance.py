"""LoRA training is the same step whatever runs it: dp=1 ≡ dp=2 ≡ dynamic micro-batches ≡ Ulysses sp=2 ≡
activation checkpointing ≡ FSDP1 ≡ DeepSpeed ZeRO-1/2/3, for the policy and for the value model (adapters
+ a trained ``score`` head).

Each case runs two optimizer steps on the same global batch of 8 samples and is compared with fsdp2 at
dp=1: the global loss and grad norm of each step, and the merged export (``get_per_tensor_param``) after it.
Slow: about 15 s per 2-rank case on 2 CPU cores.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

from verl_trainer.engine import EngineConfig, EngineRegistry
from verl_trainer.testing.ranks import run_distributed

from .common import (
    OPTIM,
    assert_close_params,
    collect_params,
    nll_loss,
    random_batch,
    rank_shard,
    relative_error,
    tiny_model,
    value_loss,
)

pytestmark = pytest.mark.slow

LORA = {"lora_rank": 4, "lora_alpha": 8.0, "target_modules": "all-linear"}
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None

CASES = {  # name: (world size, backend, engine config overrides)
    "dp2": (2, "fsdp2", {}),
    "dp2_dynamic": (2, "fsdp2", {"use_dynamic_bsz": True, "max_token_len_per_gpu": 24}),
    "sp2": (2, "fsdp2", {"ulysses_sequence_parallel_size": 2}),
    "checkpointing": (2, "fsdp2", {"enable_gradient_checkpointing": True}),
    "fsdp1": (2, "fsdp", {}),
    "zero1": (2, "deepspeed", {"zero_stage": 1}),
    "zero2": (2, "deepspeed", {"zero_stage": 2}),
    "zero3": (2, "deepspeed", {"zero_stage": 3}),
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"))


def _train_rank(backend: str, model_type: str, model_path: str, config: dict) -> dict:
    dp_size = dist.get_world_size() // config.get("ulysses_sequence_parallel_size", 1)
    dp_rank = dist.get_rank() // config.get("ulysses_sequence_parallel_size", 1)
    engine = EngineRegistry.new(
        model_type, backend,
        EngineConfig(model_path=model_path, micro_batch_size_per_gpu=2, **LORA, **config), OPTIM,
    )
    engine.initialize()
    shard = rank_shard(random_batch(8, seed=5), dp_rank, dp_size)
    loss_fn = nll_loss if model_type == "language_model" else value_loss
    steps = []
    with engine.train_mode():
        for _ in range(2):
            out = engine.train_batch(shard, loss_fn)
            steps.append((out["loss"], out["grad_norm"]))
    return {"steps": steps, "params": collect_params(engine), "trainable": engine.num_trainable_parameters()}


@pytest.fixture(scope="module")
def baselines(model_path):
    return {mt: run_distributed(_train_rank, 1, "fsdp2", mt, model_path, {})[0]
            for mt in ("language_model", "value_model")}


def _assert_same_training(got: dict, want: dict) -> None:
    assert got["trainable"] == want["trainable"]
    for (loss, norm), (want_loss, want_norm) in zip(got["steps"], want["steps"], strict=True):
        assert relative_error(torch.tensor(loss), torch.tensor(want_loss)) < 1e-5
        assert relative_error(torch.tensor(norm), torch.tensor(want_norm)) < 1e-5
    assert sorted(got["params"]) == sorted(want["params"])
    assert_close_params(got["params"], want["params"], rtol=1e-5)


def _run_case(case: str, model_type: str, model_path: str) -> list[dict]:
    world, backend, config = CASES[case]
    if backend == "deepspeed" and not HAS_DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    return run_distributed(_train_rank, world, backend, model_type, model_path, config, timeout=600,
                           env={"DS_ACCELERATOR": "cpu"})


@pytest.mark.parametrize("case", list(CASES))
def test_lora_policy_step_is_invariant(case, model_path, baselines):
    for rank_out in _run_case(case, "language_model", model_path):
        _assert_same_training(rank_out, baselines["language_model"])


@pytest.mark.parametrize("case", ["dp2", "zero2"])
def test_lora_value_model_step_is_invariant(case, model_path, baselines):
    base = baselines["value_model"]
    assert base["trainable"] == 4096 + 32 + 1  # the adapters + the score head (weight [1, 32], bias)
    for rank_out in _run_case(case, "value_model", model_path):
        _assert_same_training(rank_out, base)
