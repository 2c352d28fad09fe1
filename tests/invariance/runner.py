"""Run cases of the invariance matrix: one process spawn per (world size, chunk), one engine per case.

Process spawns are the expensive part here (imports on a loaded 2-core machine), so a spawn loops over
many cases, building a fresh engine for each from the same model directory. Every rank returns the
scalars (loss, grad norm, reduced metrics); rank 0 also returns the updated parameters.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from tests.invariance.batch import BATCH_MULTIPLE, shard_for
from tests.invariance.cases import Case
from verl_trainer.callbacks.sequence_balancing import balance_batch
from verl_trainer.engine import EngineConfig, EngineRegistry, OptimConfig
from verl_trainer.losses import (
    PPOLossConfig,
    SFTLossConfig,
    ValueLossConfig,
    ppo_loss,
    sft_loss,
    value_loss,
)
from verl_trainer.metrics import reduce_metrics
from verl_trainer.testing.distributed import run_distributed

HIDDEN_SIZE = 32
DYNAMIC_BUDGET = 64
"""Tokens per dynamic micro-batch: just above the longest sample (60), so most micro-batches hold 1-3
samples and dp=1 runs about five of them."""
LOSS_SCALE_FACTOR = 64.0
"""The constant of ``seq-mean-token-sum-norm`` (Dr.GRPO's max response length)."""
OPTIM = OptimConfig(lr=1e4, eps=1.0, weight_decay=0.0, clip_grad=1.0)
"""A measuring device, not a training setting: AdamW whose first step is ``-lr * g / (|g| + eps)``, i.e.
about ``-1e4 g``, so the updated parameters are a scaled copy of the gradient.

* ``eps = 1`` (above every clipped gradient element) makes the step linear in the gradient. With the
  usual ``eps = 1e-8`` one AdamW step moves every element by ``lr * sign(g)``: a gradient off by any
  factor gives the same parameters, and an element whose true gradient is ~0 flips sign on round-off.
* ``lr = 1e4`` makes the update large next to the initial weights, so storing the result in float32 does
  not round it away. Measured: at ``lr = 10`` the smallest updates (~1e-2 on RMSNorm weights = 1.0, whose
  float32 spacing is 1.2e-7) carried ~1.5e-5 relative rounding error in *every* run, the reference
  included; at ``lr = 1e4`` every run matches a float64 plain-PyTorch step to < 5e-7 in every tensor.
* No weight decay: it adds the same ``-lr * wd * p`` to every run and would dilute gradient differences.
"""
ENV = {"DS_ACCELERATOR": "cpu"}


def deepspeed_available() -> bool:
    """True when the deepspeed backend is installed and registered."""
    if importlib.util.find_spec("deepspeed") is None:
        return False
    try:
        EngineRegistry.get_engine_cls("language_model", "deepspeed")
    except Exception:  # noqa: BLE001 - not registered, or its module failed to import
        return False
    return True


def make_loss_fn(case: Case) -> Callable[..., Any]:
    """The loss function of ``case`` (PPO with entropy bonus and KL loss on)."""
    factor = LOSS_SCALE_FACTOR if case.agg == "seq-mean-token-sum-norm" else None
    if case.loss == "ppo":
        return ppo_loss(PPOLossConfig(loss_agg_mode=case.agg, entropy_coeff=0.01, use_kl_loss=True,
                                      kl_loss_coef=0.1, kl_loss_type="low_var_kl",
                                      loss_scale_factor=factor))
    if case.loss == "value":
        return value_loss(ValueLossConfig(cliprange_value=0.5, loss_agg_mode=case.agg,
                                          loss_scale_factor=factor))
    return sft_loss(SFTLossConfig(loss_agg_mode=case.agg, loss_scale_factor=factor))


def engine_config(case: Case, model_path: str) -> EngineConfig:
    """The engine config of ``case``'s micro-batching (fp32 everywhere)."""
    micro: dict[str, Any] = {
        "one": {"micro_batch_size_per_gpu": 64},
        "fixed1": {"micro_batch_size_per_gpu": 1},
        "fixed2": {"micro_batch_size_per_gpu": 2},
        "dynamic": {"use_dynamic_bsz": True, "max_token_len_per_gpu": DYNAMIC_BUDGET},
    }[case.micro]
    return EngineConfig(model_path=model_path, **micro)


def run_case_on_rank(case: Case, model_path: str, batch: TensorDict) -> dict[str, Any]:
    """One step of ``case`` on this rank; a collective (every rank of the world runs it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != case.dp:
        raise ValueError(f"case {case.id} needs {case.dp} ranks, this world has {world}")
    start = time.perf_counter()
    shard = shard_for(batch, rank, case.dp, case.balance)
    if case.balance:
        shard, _ = balance_batch(shard, None, hidden_size=HIDDEN_SIZE, batch_multiple=BATCH_MULTIPLE)
    engine = EngineRegistry.new(case.model_type, case.strategy, engine_config(case, model_path), OPTIM)
    engine.initialize()
    kwargs = {"calculate_entropy": True} if case.loss == "ppo" else {}
    with engine.train_mode():
        out = engine.train_batch(shard, make_loss_fn(case), **kwargs)
    metrics = reduce_metrics(out["metrics"])
    params = {name: t.detach().cpu().clone() for name, t in engine.get_per_tensor_param()}
    del engine
    return {
        "loss": out["loss"],
        "grad_norm": out["grad_norm"],
        "step_skipped": out["step_skipped"],
        "num_micro_batches": out["num_micro_batches"],
        "samples": shard.batch_size[0],
        "padding": int(shard["is_padding"].sum()),
        "metrics": metrics,
        "params": params if rank == 0 else None,
        "seconds": time.perf_counter() - start,
    }


def run_cases_on_rank(cases: list[Case], model_path: str, batch: TensorDict) -> dict[Case, Any]:
    """Every case in order (a collective); returns ``{case: result}``."""
    return {case: run_case_on_rank(case, model_path, batch) for case in cases}


def merge_ranks(per_rank: list[dict[Case, Any]]) -> dict[Case, dict[str, Any]]:
    """Rank 0's result per case, plus the loss / grad norm / micro-batch count of every rank."""
    merged = {}
    for case, result in per_rank[0].items():
        result = dict(result)
        result["rank_losses"] = [r[case]["loss"] for r in per_rank]
        result["rank_grad_norms"] = [r[case]["grad_norm"] for r in per_rank]
        result["rank_micro_batches"] = [r[case]["num_micro_batches"] for r in per_rank]
        result["rank_metrics"] = [r[case]["metrics"] for r in per_rank]
        result["rank_samples"] = [r[case]["samples"] for r in per_rank]
        result["rank_padding"] = [r[case]["padding"] for r in per_rank]
        merged[case] = result
    return merged


def chunk_key(case: Case) -> tuple[int, str]:
    """Cases run together in one spawn: same world size and loss kind (at most ~60 cases).

    Small enough chunks keep every spawn well inside pytest's per-test timeout; the default slice needs
    just two spawns (the 1-rank references and the 2-rank cases).
    """
    return case.dp, case.loss


def run_order(case: Case) -> tuple[bool, Case]:
    """DeepSpeed cases last in a spawn: its process-wide setup then cannot touch an FSDP case."""
    return case.strategy == "deepspeed", case


def run_chunk(cases: Iterable[Case], model_path: str, batch: TensorDict,
              timeout: float = 1800.0) -> dict[Case, dict[str, Any]]:
    """Run ``cases`` (one world size) in one spawn; returns the merged results."""
    cases = sorted(cases, key=run_order)
    worlds = {c.dp for c in cases}
    if len(worlds) != 1:
        raise ValueError(f"one spawn runs one world size, got {sorted(worlds)}")
    per_rank = run_distributed(run_cases_on_rank, worlds.pop(), cases, model_path, batch,
                               timeout=timeout, env=ENV)
    return merge_ranks(per_rank)


def initial_params(model_path: str, model_type: str) -> dict[str, torch.Tensor]:
    """The parameters before the step (to measure the update), named as the engines export them."""
    from tests.invariance.batch import VALUE_SEED
    from verl_trainer.models.tiny import load_causal_lm, load_value_model

    if model_type == "value_model":
        model = load_value_model(model_path, seed=VALUE_SEED)
    else:
        model = load_causal_lm(model_path)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
