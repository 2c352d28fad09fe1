"""Shared pieces of the engine tests: a tiny model, batches, real loss functions and the plain-PyTorch
single-process reference step. (The DeepSpeed engine tests import these too.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_trainer.data.packing import make_batch
from verl_trainer.engine import EngineConfig, EngineRegistry, GlobalBatchInfo, OptimConfig
from verl_trainer.models.loading import load_causal_lm, load_value_model
from verl_trainer.models.tiny import make_tiny_model

VOCAB_LOW, VOCAB_HIGH = 4, 60
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.01, clip_grad=1.0)
# The value model's backbone gets gradients near fp32 round-off in places, which AdamW normalises to
# ~lr-sized updates: at lr=1e-2 (updates as large as the 0.02-scale init) two of them differ by 1.4e-5
# relative after two steps; at lr=1e-3 the parameters agree to 2e-6.
VALUE_OPTIM = OptimConfig(lr=1e-3, weight_decay=0.01, clip_grad=1.0)


def tiny_model(path: str) -> str:
    """A 2-layer Llama (hidden 32) written with save_pretrained.

    Llama, not Qwen2: Qwen2's k_proj bias has an exactly-zero true gradient (softmax is shift-invariant),
    so AdamW turns its round-off noise into ±lr updates that no tolerance can compare.
    """
    return make_tiny_model(path, arch="llama", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, seed=1)


def random_batch(batch_size: int = 8, seed: int = 0, max_prompt: int = 6,
                 max_response: int = 9) -> TensorDict:
    """Samples of different lengths; returns/advantages filled for the value loss."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(batch_size):
        p = int(torch.randint(1, max_prompt + 1, (1,), generator=g))
        r = int(torch.randint(1, max_response + 1, (1,), generator=g))
        prompts.append(torch.randint(VOCAB_LOW, VOCAB_HIGH, (p,), generator=g).tolist())
        responses.append(torch.randint(VOCAB_LOW, VOCAB_HIGH, (r,), generator=g).tolist())
    batch = make_batch(prompts, responses)
    batch["returns"] = torch.randn(batch["input_ids"].shape, generator=g) * batch["loss_mask"]
    return batch


def nll_loss(model_output: dict[str, torch.Tensor], micro_batch: TensorDict,
             info: GlobalBatchInfo) -> tuple[torch.Tensor, dict[str, Any]]:
    """Masked NLL summed over the micro-batch / global batch_num_tokens × dp_size (token-mean)."""
    mask = micro_batch["loss_mask"].float()
    loss = -(model_output["log_probs"] * mask).sum() / info.batch_num_tokens * info.dp_size
    return loss, {"loss": loss.detach().item()}


def value_loss(model_output: dict[str, torch.Tensor], micro_batch: TensorDict,
               info: GlobalBatchInfo) -> tuple[torch.Tensor, dict[str, Any]]:
    """Masked 0.5·(V − R)² summed / global batch_num_tokens × dp_size."""
    mask = micro_batch["loss_mask"].float()
    err = (model_output["values"] - micro_batch["returns"]) ** 2
    loss = 0.5 * (err * mask).sum() / info.batch_num_tokens * info.dp_size
    return loss, {"vf_loss": loss.detach().item()}


def rank_shard(batch: TensorDict, rank: int, world: int, sizes: list[int] | None = None) -> TensorDict:
    """Contiguous shard ``rank`` of ``world``: equal sizes, or ``sizes[r]`` samples for rank ``r``."""
    if sizes is None:
        n = batch.batch_size[0] // world
        return batch[rank * n:(rank + 1) * n]
    start = sum(sizes[:rank])
    return batch[start:start + sizes[rank]]


# ------------------------------------------------------------------------------ plain reference
def used_targets(batch: TensorDict) -> torch.Tensor:
    """``[B, T]`` bool: where a language model's outputs are computed (``loss_mask`` or ``response_mask``).

    The LM head runs only there (``PackedBatch.output_mask``); log-probs / entropy are 0 elsewhere.
    """
    return (batch["loss_mask"] > 0) | (batch["response_mask"] > 0)


def padded_log_probs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] next-token log-probs of a padded batch (position 0 is 0)."""
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.cat([lp.new_zeros(lp.shape[0], 1), lp], 1)


def padded_values(logits: torch.Tensor) -> torch.Tensor:
    """[B, T] values: position t reads the head at t - 1 (position 0 is 0)."""
    v = logits[..., 0].float()
    return torch.cat([v.new_zeros(v.shape[0], 1), v[:, :-1]], 1)


def reference_step(model_path: str, batch: TensorDict, optim: OptimConfig, model_type: str = "language_model",
                   seed: int = 42, steps: int = 1,
                   make_optimizer: Callable[[Any], torch.optim.Optimizer] | None = None) -> dict[str, Any]:
    """One (or more) single-process plain-PyTorch step(s) on the whole padded batch.

    The optimizer is AdamW from ``optim``'s lr / betas / eps / weight decay, or ``make_optimizer(params)``.
    """
    if model_type == "language_model":
        model = load_causal_lm(model_path, attn_implementation="sdpa")
    else:
        model = load_value_model(model_path, attn_implementation="sdpa", seed=seed)
    model.train()
    if make_optimizer is not None:
        opt = make_optimizer(model.parameters())
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps,
                                weight_decay=optim.weight_decay)
    info = GlobalBatchInfo(dp_size=1, batch_num_tokens=int(batch["loss_mask"].sum()),
                           global_batch_size=batch.batch_size[0])
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad()
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        if model_type == "language_model":
            loss, _ = nll_loss({"log_probs": padded_log_probs(out.logits, batch["input_ids"])}, batch, info)
        else:
            loss, _ = value_loss({"values": padded_values(out.logits)}, batch, info)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), optim.clip_grad)))
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "grad_norms": norms,
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


# ------------------------------------------------------------------------------ per-rank bodies
def build_engine(backend: str, model_type: str, model_path: str, optim: OptimConfig | None,
                 **config: Any) -> Any:
    engine = EngineRegistry.new(model_type, backend, EngineConfig(model_path=model_path, **config), optim)
    engine.initialize()
    return engine


def collect_params(engine: Any) -> dict[str, torch.Tensor]:
    """Full tensors from get_per_tensor_param (every rank iterates; all get the same)."""
    return {name: t.detach().cpu().clone() for name, t in engine.get_per_tensor_param()}


def train_steps_on_rank(backend: str, model_type: str, model_path: str, batch: TensorDict,
                        optim: OptimConfig, steps: int = 1, **config: Any) -> dict[str, Any]:
    """Build an engine on this rank, run ``steps`` train_batch on this rank's shard, export params."""
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = build_engine(backend, model_type, model_path, optim, **config)
    loss_fn = nll_loss if model_type == "language_model" else value_loss
    shard = rank_shard(batch, rank, world)
    results = []
    with engine.train_mode():
        for _ in range(steps):
            results.append(engine.train_batch(shard, loss_fn))
    params = collect_params(engine)
    return {"results": results, "params": params if rank == 0 else None}


def save_load_step_rank(backend: str, model_path: str, batches: list[TensorDict], optim: OptimConfig,
                        ckpt: str) -> dict[str, Any]:
    """Step, save, step on one engine; load the save into a fresh engine and step it the same.

    Returns ``exact`` (the two engines' parameters equal bitwise), the checkpoint's meta, both lrs,
    whether the RNG was restored, and the restored optimizer's first state (``step_state``: its ``step``
    for Adam-style state, ``state_keys``: its keys, e.g. SGD's ``momentum_buffer``).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    shards = [rank_shard(b, rank, world) for b in batches]
    a = build_engine(backend, "language_model", model_path, optim, micro_batch_size_per_gpu=2)
    a.train_batch(shards[0], nll_loss)
    a.lr_scheduler_step()
    a.save_checkpoint(ckpt, global_step=1)
    with torch.random.fork_rng(devices=[]):
        want_rng = torch.rand(4)  # what the RNG gives right after the save
    torch.manual_seed(1234)
    b = build_engine(backend, "language_model", model_path, optim, micro_batch_size_per_gpu=2)
    meta = b.load_checkpoint(ckpt)
    b.apply_optim_config()  # as a resume does (loops.py): unchanged settings change nothing
    rng_restored = torch.equal(torch.rand(4), want_rng)
    for engine in (a, b):  # step -> step   vs   save -> load -> step
        engine.train_batch(shards[1], nll_loss)
        engine.lr_scheduler_step()
    lrs = a.get_lr(), b.get_lr()
    pa, pb = collect_params(a), collect_params(b)
    exact = all(torch.equal(pa[k], pb[k]) for k in pa) and pa.keys() == pb.keys()
    first = next(iter(b.optimizer.state.values()))
    return {"exact": exact, "meta": meta, "lrs": lrs, "rng_restored": rng_restored,
            "step_state": float(first["step"]) if "step" in first else None, "state_keys": sorted(first)}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (norm-wise relative error)."""
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def assert_close_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                        rtol: float = 1e-5) -> None:
    """Every tensor of ``want`` is in ``got`` with a norm-wise relative error <= ``rtol``.

    Norm-wise, not element-wise: AdamW's update is ~lr·sign(g) for elements whose gradient is round-off
    noise, so single near-zero elements may differ by ~lr while the tensor agrees to 1e-7.
    """
    missing = sorted(set(want) - set(got))
    assert not missing, f"exported params miss {missing}"
    errors = {name: relative_error(got[name], value) for name, value in want.items()}
    bad = {k: v for k, v in errors.items() if v > rtol}
    assert not bad, f"relative errors above {rtol}: {bad}"
