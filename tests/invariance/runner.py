"""Run cases of the invariance matrix: one process spawn per (world size, chunk), one engine per case.

Process spawns are the expensive part here (imports on a loaded 2-core machine), so a spawn loops over
many cases, building a fresh engine for each from the same model directory. Per case and rank: build the
engine (its ``(dp, sp)`` or ``(dp, tp)`` mesh), take the starting shard of this rank's **DP** rank (every
SP / TP rank of a DP group holds the same samples), balance over the engine's DP group when the case
balances, run a forward (the model outputs of the initial parameters) and one training step. Every rank
returns the scalars (loss, grad norm, reduced metrics), its mesh coordinates, the uids it trained on and
its outputs per sample; rank 0 also returns the updated parameters.
"""

from __future__ import annotations

import hashlib
import os
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from tests.invariance.batch import BATCH_MULTIPLE, batch_for, shard_for
from tests.invariance.cases import (
    CORRECTION_LOSS,
    DISTILL_LOSSES,
    LIBRARY_BACKENDS,
    MOE_LOSSES,
    MOE_REPLAY_LOSS,
    OBJECTIVE_CASE_LOSSES,
    PPO_LOSSES,
    PREFERENCE_LOSSES,
    RM_LOSS,
    VERSION_LOSS,
    VLM_LOSSES,
    XFAIL,
    Case,
)
from tests.invariance.distill import distill_loss_fn
from tests.invariance.versions import VersionedPPOLoss
from verl_trainer.callbacks.sequence_balancing import balance_batch
from verl_trainer.core_algos import RolloutCorrectionConfig
from verl_trainer.core_algos.losses import (
    PPOLossConfig,
    SFTLossConfig,
    ValueLossConfig,
    ppo_loss,
    sft_loss,
    value_loss,
)
from verl_trainer.core_algos.preference import PreferenceLossConfig, preference_loss
from verl_trainer.core_algos.reward_modeling import RewardLossConfig, RewardModelLoss
from verl_trainer.engine import EngineConfig, EngineRegistry, OptimConfig
from verl_trainer.engine.registry import missing_package
from verl_trainer.metrics import reduce_metrics
from verl_trainer.models.moe_config import MoEConfig
from verl_trainer.models.tiny import make_tiny_model
from verl_trainer.testing.ranks import DistributedTestError, run_distributed

HIDDEN_SIZE = 32
DYNAMIC_BUDGET = 64
"""Tokens per dynamic micro-batch: just above the longest sample (60), so most micro-batches hold 1-3
samples and dp=1 runs about five of them. Under SP the engine's budget is ``max_token_len_per_gpu x sp``
per micro-batch, so an SP case sets ``max_token_len_per_gpu = DYNAMIC_BUDGET // sp``: the same 64-token
micro-batches, each SP rank running 1/sp of them (with 64 per rank, dp=2 x sp=2 would run one micro-batch
per rank and "dynamic" would test nothing)."""
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
OBJECTIVE_LOSS_SETTINGS: dict[str, dict[str, Any]] = {
    "dppo_tv": {"clip_ratio": 0.003},  # the tiny model's token probabilities are ~1e-2: a TV gap of 0.003
    "dppo_kl": {"clip_ratio": 1e-4},   # (binary KL 1e-4) masks some tokens out
    "clip_cov": {"clip_cov_ratio": 0.1, "clip_cov_lb": 0.0, "clip_cov_ub": 5.0},  # ~20 of ~200 tokens
    "kl_cov": {"kl_cov_ratio": 0.1, "ppo_kl_coef": 1.0},
}
"""Settings of the policy-loss block that make each loss's discrete choice select a real share of tokens."""


def backend_available(strategy: str) -> bool:
    """True when the backend ``strategy`` is installed and registered (deepspeed, torchtitan, megatron)."""
    if missing_package(strategy) is not None:
        return False
    try:
        EngineRegistry.get_engine_cls("language_model", strategy)
    except Exception:  # noqa: BLE001 - not registered, or its module failed to import
        return False
    return True


def make_loss_fn(case: Case) -> Callable[..., Any]:
    """The loss function of ``case`` (PPO with entropy bonus and KL loss on; ``ppo_is``: and token-level
    TIS of the rollout -> trainer ratio, threshold 2: the batch's ratios are e^{+-1} and e^{+-0.2};
    ``ppo_mt``: the PPO loss, on the multi-turn batch)."""
    factor = LOSS_SCALE_FACTOR if case.agg == "seq-mean-token-sum-norm" else None
    if case.loss in DISTILL_LOSSES:  # the distillation block
        return distill_loss_fn(case.loss, case.agg, factor)
    if case.loss in OBJECTIVE_CASE_LOSSES:  # the policy losses beyond PPO, entropy bonus and KL loss on
        return ppo_loss(PPOLossConfig(loss_agg_mode=case.agg, policy_loss=case.loss[len("pl_"):],
                                      entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1,
                                      **OBJECTIVE_LOSS_SETTINGS.get(case.loss[len("pl_"):], {})))
    if case.loss in MOE_LOSSES:  # the MoE block: the PPO loss (router losses added by the engine)
        return make_loss_fn(replace(case, loss="ppo"))
    if case.loss == VERSION_LOSS:  # the version-fields block: token TIS + version metrics
        return VersionedPPOLoss(case.agg, factor)
    if case.loss in VLM_LOSSES:  # the VLM block: the PPO loss on the batch with images
        return make_loss_fn(replace(case, loss="ppo"))
    if case.loss in PPO_LOSSES:
        correction = RolloutCorrectionConfig(level="token", threshold=2.0) if case.loss == CORRECTION_LOSS \
            else None
        return ppo_loss(PPOLossConfig(loss_agg_mode=case.agg, entropy_coeff=0.01, use_kl_loss=True,
                                      kl_loss_coef=0.1, kl_loss_type="low_var_kl",
                                      loss_scale_factor=factor), correction)
    if case.loss in PREFERENCE_LOSSES:  # the preference block: DPO sigmoid / KTO, beta 0.5
        loss_type = "sigmoid" if case.loss == "dpo" else "kto"
        return preference_loss(PreferenceLossConfig(loss_type=loss_type, beta=0.5, undesirable_weight=1.5))
    if case.loss == RM_LOSS:  # the reward-model block: Bradley–Terry with margins and centring
        return RewardModelLoss(RewardLossConfig(center_rewards_coefficient=0.1))
    if case.loss == "value":
        return value_loss(ValueLossConfig(cliprange_value=0.5, loss_agg_mode=case.agg,
                                          loss_scale_factor=factor))
    return sft_loss(SFTLossConfig(loss_agg_mode=case.agg, loss_scale_factor=factor))


def engine_config(case: Case, model_path: str) -> EngineConfig:
    """The engine config of ``case``'s micro-batching and SP size (fp32 everywhere)."""
    micro: dict[str, Any] = {
        "one": {"micro_batch_size_per_gpu": 64},
        "fixed1": {"micro_batch_size_per_gpu": 1},
        "fixed2": {"micro_batch_size_per_gpu": 2},
        "dynamic": {"use_dynamic_bsz": True, "max_token_len_per_gpu": DYNAMIC_BUDGET // case.sp},
    }[case.micro]
    if case.loss in MOE_LOSSES:  # the MoE block: its model, router losses and metrics, replay
        micro["moe"] = MoEConfig(aux_loss_coeff=0.01, z_loss_coeff=0.001,
                                 router_replay="rollout" if case.loss == MOE_REPLAY_LOSS else "off")
        model_path = moe_model_path(model_path)
    if case.loss in VLM_LOSSES:  # the VLM block: its model; a budget counting tokens + image patch rows
        model_path = vlm_model_path(model_path)
        if case.micro == "dynamic":
            micro["max_token_len_per_gpu"] = VLM_DYNAMIC_BUDGET
    return EngineConfig(model_path=model_path, ulysses_sequence_parallel_size=case.sp,
                        tensor_model_parallel_size=case.tp, pipeline_model_parallel_size=case.pp, **micro)


def moe_model_path(model_path: str) -> str:
    """The MoE block's tiny Qwen3-MoE (hidden 32, 2 layers, 4 experts, top-2) next to the dense model:
    written once (by rank 0 under a process group: transformers saves weights on the main process only)."""
    path = model_path.rstrip("/") + "-qwen3moe"
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and not os.path.exists(os.path.join(path, "config.json")):
        make_tiny_model(path, arch="qwen3_moe", hidden_size=HIDDEN_SIZE, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, seed=1)
    if dist.is_initialized():
        dist.barrier()
    return path


# ---------------------------------------------------------------- vision-language block (issue 44)
VLM_DYNAMIC_BUDGET = 96
"""The VLM block's dynamic budget: tokens + image patch rows per micro-batch (the longest sample: ~80)."""


def vlm_model_path(model_path: str) -> str:
    """The VLM block's tiny Qwen2.5-VL (text hidden 64, 2 layers; vision hidden 32, depth 2) next to the dense
    model: written once (by rank 0 under a process group)."""
    from verl_trainer.models.tiny_vlm import make_tiny_vlm

    path = model_path.rstrip("/") + "-qwen25vl"
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and not os.path.exists(os.path.join(path, "config.json")):
        make_tiny_vlm(path, seed=1)
    if dist.is_initialized():
        dist.barrier()
    return path


_VLM_BATCHES: dict[str, TensorDict] = {}


def vlm_batch_for(model_path: str) -> TensorDict:
    """The VLM block's global batch (``batch.vlm_invariance_batch``), built once per process."""
    from tests.invariance.batch import vlm_invariance_batch

    path = vlm_model_path(model_path)
    if path not in _VLM_BATCHES:
        _VLM_BATCHES[path] = vlm_invariance_batch(path)
    return _VLM_BATCHES[path]


def outputs_by_uid(output: dict[str, torch.Tensor], batch: TensorDict) -> dict[int, dict[str, torch.Tensor]]:
    """Per real sample: ``{uid: {key: [L - 1] values at positions 1 .. L - 1}}`` (padding samples dropped).

    Position 0 has no next-token output (it is 0 by convention), so the compared positions are the real
    tokens after the first where outputs are used (``loss_mask`` or ``response_mask``; the LM head runs
    only there, other positions are 0 on both sides) — the log-probs / entropy / values every loss reads.
    """
    lengths = batch["attention_mask"].sum(-1).long().tolist()
    used = ((batch["loss_mask"] > 0) | (batch["response_mask"] > 0)).cpu()
    rows = zip(batch["uid"].tolist(), lengths, batch["is_padding"].tolist())
    return {int(uid): {k: (v[i, 1:n].detach().cpu() * used[i, 1:n].reshape(-1, *[1] * (v.dim() - 2))).clone()
                       for k, v in output.items()}  # [B, T, k] outputs too (gathered_log_probs)
            for i, (uid, n, pad) in enumerate(rows) if not pad}


def digest(batch: TensorDict) -> str:
    """A hash of every entry of ``batch`` (names, dtypes, shapes, values): equal iff the batches are."""
    h = hashlib.sha1()
    for key in sorted(batch.keys()):
        value = batch[key].detach().cpu().contiguous()
        h.update(f"{key}:{value.dtype}:{tuple(value.shape)}".encode())
        h.update(value.reshape(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return h.hexdigest()


def run_case_on_rank(case: Case, model_path: str, batch: TensorDict) -> dict[str, Any]:
    """One step of ``case`` on this rank; a collective (every rank of the world runs it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != case.world:
        raise ValueError(f"case {case.id} needs {case.world} ranks, this world has {world}")
    start = time.perf_counter()
    engine = EngineRegistry.new(case.model_type, case.strategy, engine_config(case, model_path), OPTIM)
    engine.initialize()
    topo = engine.topology
    if (topo.dp_size, topo.sp_size, topo.tp_size, topo.pp_size) != (case.dp, case.sp, case.tp, case.pp):
        raise ValueError(f"case {case.id}: the engine's mesh is dp={topo.dp_size} x sp={topo.sp_size} x "
                         f"tp={topo.tp_size} x pp={topo.pp_size}")
    # every SP / TP rank of a DP group starts from (and, balanced, ends with) that DP rank's samples: the
    # starting shard is chosen by dp_rank and the exchange runs within the DP group
    global_batch = vlm_batch_for(model_path) if case.loss in VLM_LOSSES else batch_for(case, batch)
    shard = shard_for(global_batch, topo.dp_rank, case.dp, case.balance)
    balance_metrics: dict[str, float] = {}
    if case.balance:
        shard, balance_metrics = balance_batch(shard, engine.get_data_parallel_group(),
                                               hidden_size=HIDDEN_SIZE, batch_multiple=BATCH_MULTIPLE)
    entropy = {"calculate_entropy": True} if case.model_type == "language_model" else {}
    with engine.eval_mode():
        infer = engine.infer_batch(shard, **entropy)
    kwargs = {"calculate_entropy": True} if case.loss in PPO_LOSSES + OBJECTIVE_CASE_LOSSES else {}
    if case.loss in MOE_LOSSES + VLM_LOSSES:  # the MoE and VLM blocks: PPO's entropy bonus
        kwargs = {"calculate_entropy": True}
    if case.loss == VERSION_LOSS:  # the version-fields block: PPO's entropy bonus
        kwargs = {"calculate_entropy": True}
    loss_fn = make_loss_fn(case)
    if getattr(loss_fn, "needs_prepare", False):  # clip-cov / KL-cov: the step-wide selection (collective)
        shard = loss_fn.prepare(shard, engine.get_data_parallel_group())
    with engine.train_mode():
        out = engine.train_batch(shard, loss_fn, **kwargs)
    metrics = reduce_metrics(out["metrics"])
    params = {name: t.detach().cpu().clone() for name, t in engine.get_per_tensor_param()}
    engine_src = engine.is_mp_src_rank_with_outputs()
    del engine
    return {
        "loss": out["loss"],
        "grad_norm": out["grad_norm"],
        "step_skipped": out["step_skipped"],
        "num_micro_batches": out["num_micro_batches"],
        "infer_micro_batches": infer["num_micro_batches"],
        # (dp rank, rank within it)
        "mesh": (topo.dp_rank, topo.sp_rank * topo.tp_size + topo.tp_rank + topo.pp_rank),
        "mp_src": engine_src,
        "uids": shard["uid"].tolist(),
        "digest": digest(shard),
        "balance_metrics": balance_metrics,
        "samples": shard.batch_size[0],
        "padding": int(shard["is_padding"].sum()),
        "metrics": metrics,
        "outputs": outputs_by_uid(infer["model_output"], shard),
        "params": params if rank == 0 else None,
        "seconds": time.perf_counter() - start,
    }


def run_cases_on_rank(cases: list[Case], model_path: str, batch: TensorDict) -> dict[Case, Any]:
    """Every case in order (a collective); returns ``{case: result}``."""
    return {case: run_case_on_rank(case, model_path, batch) for case in cases}


def merge_outputs(per_rank: list[dict[str, Any]]) -> tuple[dict[int, dict[str, torch.Tensor]], float]:
    """Every real sample's outputs (from the SP / TP rank 0 of the DP rank holding it), and the max
    relative difference between the SP / TP ranks of one DP group for the same sample (they must agree)."""
    merged: dict[int, dict[str, torch.Tensor]] = {}
    spread = 0.0
    for r in sorted(per_rank, key=lambda r: r["mesh"][1]):  # SP / TP rank 0 (PP: stage 0) first
        for uid, outs in r["outputs"].items():
            if uid not in merged:
                merged[uid] = outs
                continue
            for k, v in outs.items():
                want = merged[uid][k].double()
                diff = float((v.double() - want).norm())
                scale = float(want.norm())
                spread = max(spread, diff / scale if scale else (0.0 if diff == 0 else float("inf")))
    return merged, spread


def merge_ranks(per_rank: list[dict[Case, Any]]) -> dict[Case, dict[str, Any]]:
    """Rank 0's result per case, plus the per-rank loss / grad norm / micro-batch count / mesh / uids, and
    the outputs of every sample merged over ranks."""
    merged = {}
    for case, result in per_rank[0].items():
        result = dict(result)
        ranks = [r[case] for r in per_rank]
        for key in ("loss", "grad_norm", "num_micro_batches", "infer_micro_batches", "metrics", "samples",
                    "padding", "mesh", "mp_src", "uids", "digest", "balance_metrics"):
            result[f"rank_{key}"] = [r[key] for r in ranks]
        result["rank_losses"] = result.pop("rank_loss")  # the name compare.py reads
        result["outputs"], result["sp_output_spread"] = merge_outputs(ranks)
        merged[case] = result
    return merged


def chunk_key(case: Case) -> tuple:
    """Cases run together in one spawn: same world size, SP size and loss kind (at most ~70 cases).

    Small enough chunks keep every spawn well inside pytest's per-test timeout; the default slice needs
    three spawns (the 1-rank references, the 2-rank cases and one 4-rank dp=2 x sp=2 case). A case in
    ``XFAIL`` runs in a spawn of its own (a failing rank ends the spawn it is in), and a library backend's
    cases in spawns of their own (its library's process-wide state stays out of the others').
    """
    loss = "ppo" if case.loss in PPO_LOSSES else case.loss  # the correction and multi-turn join ppo's spawn
    loss = "preference" if case.loss in PREFERENCE_LOSSES else loss  # DPO and KTO share their spawns
    loss = "distill" if case.loss in DISTILL_LOSSES else loss  # the distillation losses share their spawns
    loss = "preference" if case.loss == RM_LOSS else loss  # the reward-model block joins preference's spawns
    if case.loss in OBJECTIVE_CASE_LOSSES:  # the policy-loss block: one spawn per world size and agg mode
        loss = f"objectives/{case.agg}"
    if case.loss in MOE_LOSSES:  # the MoE block: its own spawns (its own model)
        loss = "moe"
    if case.loss == VERSION_LOSS:  # the version-fields block joins ppo's spawns
        loss = "ppo"
    if case.loss in VLM_LOSSES:  # the VLM block: its own spawns (its own model and batch)
        loss = "vlm"
    if case in XFAIL:
        return case.world, case.sp, loss, case.id
    if case.strategy in LIBRARY_BACKENDS:
        return case.world, case.sp, loss, case.strategy
    return case.world, case.sp, loss


def run_order(case: Case) -> tuple[bool, Case]:
    """DeepSpeed cases last in a spawn: its process-wide setup then cannot touch an FSDP case."""
    return case.strategy == "deepspeed", case


def run_chunk(cases: Iterable[Case], model_path: str, batch: TensorDict,
              timeout: float = 1800.0) -> dict[Case, dict[str, Any]]:
    """Run ``cases`` (one world size) in one spawn; returns the merged results."""
    cases = sorted(cases, key=run_order)
    worlds = {c.world for c in cases}
    if len(worlds) != 1:
        raise ValueError(f"one spawn runs one world size, got {sorted(worlds)}")
    world = worlds.pop()

    def run() -> list[Any]:
        return run_distributed(run_cases_on_rank, world, cases, model_path, batch, timeout=timeout, env=ENV)

    try:
        per_rank = run()
    except DistributedTestError as err:
        if err.crash_signal is None:
            raise
        # A rank killed by a native crash (seen once in CI: SIGABRT from a corrupted heap; 7 reruns of that
        # chunk did not reproduce it) would fail every case of the chunk: it runs once more on new
        # processes; the warning (pytest's summary) and the rank's stack (faulthandler) keep the crash seen.
        warnings.warn(f"invariance chunk of {len(cases)} cases (first {cases[0].id}): {err}; run again on "
                      f"new ranks", RuntimeWarning, stacklevel=1)
        per_rank = run()
    return merge_ranks(per_rank)


def initial_params(model_path: str, model_type: str) -> dict[str, torch.Tensor]:
    """The parameters before the step (to measure the update), named as the engines export them."""
    from tests.invariance.batch import VALUE_SEED
    from verl_trainer.models.loading import load_causal_lm, load_value_model

    if model_type == "value_model":
        model = load_value_model(model_path, seed=VALUE_SEED)
    else:
        model = load_causal_lm(model_path)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
