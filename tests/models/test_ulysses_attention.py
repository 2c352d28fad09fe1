"""Ulysses SP attention on tiny HF models: sp=2 (and dp=2 x sp=2, sp=4) equals the sp=1 packed forward.

Each case runs on real gloo ranks. Every rank loads the same checkpoint twice: a reference with
``"verl_varlen"`` (the plain packed path, sp=1) and the SP model with ``"verl_ulysses"``. The reference
runs every DP group's batch in one process; the SP model runs its DP group's batch sliced over the SP
group. Compared (rtol 1e-5): log-probs, entropy, logits, values, the loss, and the parameter gradients
after the all-reduce the engine's FSDP performs (the AVERAGE over all ``dp * sp`` ranks; the gathered
gradient carries the ``sp`` factor, the loss the ``dp`` factor).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from verl_trainer.data.packing import make_batch, next_token_log_probs_and_entropy, pack_batch
from verl_trainer.models import (
    VARLEN_ATTENTION,
    load_causal_lm,
    load_value_model,
    make_tiny_model,
    packed_forward,
)
from verl_trainer.models.ulysses_attention import (
    ULYSSES_ATTENTION,
    check_ulysses_compatible,
    repeat_kv_for_sp,
    ulysses_attention_forward,
)
from verl_trainer.models.ulysses_forward import (
    ulysses_packed_forward,
    ulysses_packed_log_probs,
    ulysses_packed_values,
    ulysses_slice_packed,
)
from verl_trainer.testing import run_distributed

RTOL, ATOL = 1e-5, 1e-6
ODD = [5, 1, 9, 4, 6]  # 25 tokens: padded to 26 (sp=2) / 28 (sp=4)
EVEN = [7, 3, 8, 2, 4]  # 24 tokens: no padding


def _batch(lengths: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(4, 60, (n,), generator=g).tolist() for n in lengths]
    batch = make_batch([s[: max(1, n // 2)] for s, n in zip(seqs, lengths)],
                       [s[max(1, n // 2):] for s, n in zip(seqs, lengths)])
    batch["advantages"] = torch.randn(batch["input_ids"].shape, generator=g) * batch["loss_mask"]
    return batch


def _loss(log_probs: torch.Tensor, entropy: torch.Tensor, packed, num_tokens: float) -> torch.Tensor:
    """A PPO-like partial loss with a global token denominator: -(A * logp) - 0.01 * H."""
    mask, adv = packed.fields["loss_mask"][0], packed.fields["advantages"][0]
    return (-(adv * log_probs) - 0.01 * entropy * mask).sum() / num_tokens


def _entropy_ref(logits: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    logits = logits[0].float()
    ent = torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)
    out = torch.cat([ent.new_zeros(1), ent[:-1]])
    return out.index_fill(0, cu[:-1].long(), 0.0)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> float:
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")
    return float((got - want).detach().abs().max())


def _equivalence(path: str, sp: int, lengths_per_dp: list[list[int]], seed: int = 0) -> dict[str, float]:
    """One step of sp (x dp) vs the single-process reference; returns the largest deviations."""
    world = dist.get_world_size()
    dp = world // sp
    mesh = init_device_mesh("cpu", (dp, sp), mesh_dim_names=("dp", "sp"))
    sp_group, dp_rank = mesh.get_group("sp"), mesh.get_local_rank("dp")
    ref = load_causal_lm(path, attn_implementation=VARLEN_ATTENTION)
    model = load_causal_lm(path, attn_implementation=ULYSSES_ATTENTION)
    batches = [_batch(lengths, seed + i) for i, lengths in enumerate(lengths_per_dp)]
    assert len(batches) == dp
    num_tokens = float(sum(b["loss_mask"].sum() for b in batches))  # the DP-global denominator

    ref_loss, ref_out = torch.zeros(()), []
    for b in batches:
        packed = pack_batch(b)
        logits = packed_forward(ref, packed).logits
        lp = next_token_log_probs_and_entropy(logits, packed.input_ids, packed.cu_seqlens)[0]
        ent = _entropy_ref(logits, packed.cu_seqlens)
        ref_loss = ref_loss + _loss(lp, ent, packed, num_tokens)
        ref_out.append((lp.detach(), ent.detach(), logits.detach()))
    ref_loss.backward()

    packed = pack_batch(batches[dp_rank])
    out = ulysses_packed_log_probs(model, packed, sp_group, calculate_entropy=True)
    loss = _loss(out["log_probs"], out["entropy"], packed, num_tokens) * dp  # the engine's x dp factor
    loss.backward()
    errors = {
        "log_probs": _close(out["log_probs"], ref_out[dp_rank][0], "log_probs"),
        "entropy": _close(out["entropy"], ref_out[dp_rank][1], "entropy"),
    }
    losses = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(losses, loss.detach())
    errors["loss"] = _close(sum(losses) / (dp * sp), ref_loss.detach(), "loss")  # engine: mean over dp
    grad_err = 0.0
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)  # FSDP over the whole world averages over dp * sp ranks
        grad_err = max(grad_err, _close(grad / world, p_ref.grad, f"grad of {name}"))
    errors["grad"] = grad_err
    with torch.no_grad():
        logits = ulysses_packed_forward(model, packed, sp_group).logits
    errors["logits"] = _close(logits, ref_out[dp_rank][2], "logits")
    return errors


def _fsdp2_sp2(path: str) -> float:
    """The engine's recipe end to end: fully_shard over the world (dp=1, sp=2), FSDP averages the grads."""
    from torch.distributed.fsdp import fully_shard

    world_mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    ref = load_causal_lm(path, attn_implementation=VARLEN_ATTENTION)
    model = load_causal_lm(path, attn_implementation=ULYSSES_ATTENTION)
    for layer in model.model.layers:
        fully_shard(layer, mesh=world_mesh)
    fully_shard(model, mesh=world_mesh)
    packed = pack_batch(_batch(ODD, 7))
    num_tokens = float(packed.fields["loss_mask"].sum())
    logits = packed_forward(ref, packed).logits
    ref_lp = next_token_log_probs_and_entropy(logits, packed.input_ids, packed.cu_seqlens)[0]
    _loss(ref_lp, _entropy_ref(logits, packed.cu_seqlens), packed, num_tokens).backward()
    out = ulysses_packed_log_probs(model, packed, dist.group.WORLD, calculate_entropy=True)
    _loss(out["log_probs"], out["entropy"], packed, num_tokens).backward()
    err = 0.0
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        err = max(err, _close(p.grad.full_tensor(), p_ref.grad, f"FSDP2 grad of {name}"))
    return err


def _sp2_cases(paths: dict[str, str]) -> dict[str, dict[str, float]]:
    results = {}
    for arch, path in paths.items():
        for name, lengths in (("odd", ODD), ("even", EVEN)):
            results[f"{arch}/{name}"] = _equivalence(path, 2, [lengths])
    results["qwen2/fsdp2"] = {"grad": _fsdp2_sp2(paths["qwen2"])}
    _values_and_errors(paths["qwen2"])  # same processes: spawning ranks costs more than the checks
    return results


def _dp2_sp2_and_sp4(paths: dict[str, str]) -> dict[str, dict[str, float]]:
    results = {}
    for arch, path in paths.items():
        results[f"{arch}/dp2xsp2"] = _equivalence(path, 2, [ODD, EVEN])
    results["llama/sp4"] = _equivalence(paths["llama"], 4, [ODD], seed=3)  # 2 KV heads repeated to 4
    return results


@pytest.fixture(scope="module")
def sp_model_paths(tiny_model_paths, tmp_path_factory) -> dict[str, str]:
    """Qwen2 (4 heads, 2 KV heads) and Llama with ONE KV head (repeated for sp=2)."""
    root = tmp_path_factory.mktemp("ulysses_models")
    mqa = make_tiny_model(root / "llama_mqa", arch="llama", num_key_value_heads=1, seed=2)
    return {"qwen2": tiny_model_paths["qwen2"], "llama_mqa": mqa}


def test_sp2_matches_sp1(sp_model_paths):
    """2 ranks, sp=2: odd (padded) and even totals, GQA and MQA (KV heads repeated); then the value
    model, segments from gathered position ids, and the errors (see :func:`_values_and_errors`)."""
    results = run_distributed(_sp2_cases, 2, sp_model_paths)
    assert results[0].keys() == {"qwen2/odd", "qwen2/even", "llama_mqa/odd", "llama_mqa/even", "qwen2/fsdp2"}


def test_dp2_sp2_and_sp4_match_sp1(tiny_model_paths, sp_model_paths):
    """4 ranks: a (dp=2, sp=2) mesh with a different batch per DP group (odd and even totals); and sp=4
    (Llama's 2 KV heads repeated to 4, padding of 3)."""
    paths = {"llama": tiny_model_paths["llama"], "qwen2": sp_model_paths["qwen2"]}
    results = run_distributed(_dp2_sp2_and_sp4, 4, paths)
    assert results[0].keys() == {"llama/dp2xsp2", "llama/sp4", "qwen2/dp2xsp2"}


def _values_and_errors(path: str) -> None:
    """Value model under sp=2; segments from gathered position ids; errors for bad heads / masks / impl."""
    group = dist.group.WORLD
    ref = load_value_model(path, attn_implementation=VARLEN_ATTENTION)
    model = load_value_model(path, attn_implementation=ULYSSES_ATTENTION)
    packed = pack_batch(_batch(ODD, 5))
    with torch.no_grad():
        want = ref(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False,
                   cu_seq_lens_q=packed.cu_seqlens, cu_seq_lens_k=packed.cu_seqlens,
                   max_length_q=packed.max_seqlen, max_length_k=packed.max_seqlen).logits.reshape(-1)
        got = ulysses_packed_values(model, packed, group)["values"]
    want = torch.cat([want.new_zeros(1), want[:-1]]).index_fill(0, packed.cu_seqlens[:-1].long(), 0.0)
    _close(got, want, "values")

    # Segments from the gathered position ids (no cu_seq_lens passed) give the same attention.
    local = ulysses_slice_packed(packed, group)
    with torch.no_grad():
        a = model(input_ids=local.input_ids, position_ids=local.position_ids, use_cache=False,
                  ulysses_sp_group=group).logits
        b = model(input_ids=local.input_ids, position_ids=local.position_ids, use_cache=False,
                  ulysses_sp_group=group, cu_seq_lens_q=local.cu_seqlens, cu_seq_lens_k=local.cu_seqlens,
                  max_length_q=local.max_seqlen, max_length_k=local.max_seqlen).logits
    _close(a, b, "segments from gathered position ids")

    q = torch.randn(1, 3, 4, 8)  # 3 heads cannot be split over sp=2
    with pytest.raises(ValueError, match="num_attention_heads=3 is not divisible"):
        ulysses_attention_forward(model, q, q[:, :1], q[:, :1], None, ulysses_sp_group=group,
                                  position_ids=torch.arange(4)[None])
    with pytest.raises(NotImplementedError, match="one packed row"):
        ulysses_attention_forward(model, q[:, :2], q[:, :1], q[:, :1], torch.zeros(1, 1, 4, 4),
                                  ulysses_sp_group=group)
    sdpa = load_causal_lm(path)
    with pytest.raises(ValueError, match="needs attn_implementation='verl_ulysses'"):
        ulysses_packed_log_probs(sdpa, packed, group)


def test_check_ulysses_compatible():
    cfg = type("Cfg", (), {"num_attention_heads": 6, "num_key_value_heads": 2})()
    check_ulysses_compatible(cfg, 3, world_size=6)
    check_ulysses_compatible(cfg, 2, world_size=4)
    with pytest.raises(ValueError, match=r"heads=6 is not divisible .* choose sp in \[1, 2, 3, 6\]"):
        check_ulysses_compatible(cfg, 4, world_size=8)
    with pytest.raises(ValueError, match="does not divide the world size 4"):
        check_ulysses_compatible(cfg, 3, world_size=4)
    with pytest.raises(ValueError, match=">= 1"):
        check_ulysses_compatible(cfg, 0)


def test_repeat_kv_keeps_gqa_groups():
    """After repeating, query head h reads (a copy of) KV head h // (H / H_kv), also per SP shard."""
    h, h_kv, sp = 12, 3, 4
    k = torch.arange(h_kv, dtype=torch.float32).reshape(1, h_kv, 1, 1).expand(1, h_kv, 5, 2)
    k2, v2 = repeat_kv_for_sp(k, k, sp)
    assert k2.shape[1] == 12 and v2.shape[1] == 12  # lcm(3, 4)
    group = h // k2.shape[1]
    for shard in range(sp):  # each SP rank gets h/sp query heads and k2/sp kv heads
        q_heads = range(shard * h // sp, (shard + 1) * h // sp)
        kv_local = k2[0, shard * k2.shape[1] // sp:(shard + 1) * k2.shape[1] // sp, 0, 0]
        for i, qh in enumerate(q_heads):
            assert kv_local[i // group] == qh // (h // h_kv)
    k3, _ = repeat_kv_for_sp(k[:, :2], k[:, :2], 2)
    assert k3 is not None and k3.shape[1] == 2  # already divisible: unchanged
