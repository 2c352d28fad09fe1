"""Shared pieces of the MoE tests: the tiny Qwen3-MoE, the step run on each rank, its reduced metrics."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests.engine.common import nll_loss, random_batch, rank_shard
from verl_trainer.engine import EngineConfig, EngineRegistry, OptimConfig
from verl_trainer.metrics import MetricAccumulator
from verl_trainer.models.moe_config import MoEConfig
from verl_trainer.models.tiny import make_tiny_model

MOE = MoEConfig(aux_loss_coeff=0.01, z_loss_coeff=0.001)
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.0, clip_grad=1.0)


def tiny_moe(path: str, arch: str = "qwen3_moe") -> str:
    """A 2-layer tiny MoE (4 experts, top-2, hidden 32)."""
    return make_tiny_model(path, arch=arch, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, seed=1)


def moe_step(model_path: str, strategy: str, micro: str, moe: MoEConfig = MOE) -> dict[str, Any]:
    """One training step of the NLL loss + router losses on this rank's shard of the 8-sample batch.

    Returns the global loss, the grad norm, the metrics reduced over micro-batches and ranks, and (rank 0)
    the updated parameters.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    micro_cfg = ({"micro_batch_size_per_gpu": 64} if micro == "one"
                 else {"use_dynamic_bsz": True, "max_token_len_per_gpu": 16})
    engine = EngineRegistry.new("language_model", strategy,
                                EngineConfig(model_path=model_path, moe=moe, **micro_cfg), OPTIM)
    engine.initialize()
    shard = rank_shard(random_batch(8, seed=3), rank, world)
    with engine.train_mode():
        out = engine.train_batch(shard, nll_loss)
    acc = MetricAccumulator()
    for m in out["metrics"]:
        acc.update({k: v for k, v in m.items() if k.startswith("moe/")})
    metrics = acc.compute(engine.get_data_parallel_group())
    params = {n: t.detach().clone() for n, t in engine.get_per_tensor_param()}
    return {"loss": out["loss"], "grad_norm": out["grad_norm"], "metrics": metrics,
            "micro_batches": out["num_micro_batches"], "params": params if rank == 0 else None}


def moe_steps(model_path: str, runs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """:func:`moe_step` for each ``(strategy, micro)`` in order (one spawn)."""
    return [moe_step(model_path, strategy, micro) for strategy, micro in runs]


def max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest relative difference between same-named tensors."""
    return max(float((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-30))
               for k in b)
