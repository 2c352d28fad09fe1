"""The bucketed varlen attention (CPU path) equals the per-segment reference, forward and gradients.

Each case runs with short buckets as batched matmuls (the default: the module's matmul bucket kernel), with
every bucket as matmuls, and with every bucket as sdpa (``matmul_max_length=0``).
"""

import pytest
import torch

from verl_trainer.models.attention import varlen_attention
from verl_trainer.models.bucketed_attention import (
    MATMUL_MAX_LENGTH,
    bucketed_varlen_attention,
    plan_buckets,
    use_matmul_attention,
)
from verl_trainer.models.varlen_kernels import fused_varlen_attention, reference_varlen_attention

MIXES = {
    "ones": [1] * 7,
    "with_ones_and_empty": [1, 5, 0, 1, 9, 3, 1, 0, 12],
    "short_rl": torch.randint(8, 17, (96,), generator=torch.Generator().manual_seed(0)).tolist(),
    "long_tailed": [300, 2, 17, 64, 1, 130, 5, 33],
    "one_segment": [23],
}


def _inputs(lengths, heads, kv_heads, hf_layout, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)

    def leaf(h):
        if hf_layout:  # a transposed [1, N, H, D], as HF attention layers pass it
            return torch.randn(1, n, h, dim, generator=g).transpose(1, 2).requires_grad_(True)
        return torch.randn(1, h, n, dim, generator=g).requires_grad_(True)

    return leaf(heads), leaf(kv_heads), leaf(kv_heads), torch.randn(1, n, heads, dim, generator=g)


def _run(fn, inputs, lengths, **kwargs):
    q, k, v, grad = inputs
    for x in (q, k, v):
        x.grad = None
    out = fn(q, k, v, lengths, **kwargs)
    out.backward(grad)
    return [out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()]


def _assert_matches_reference(lengths, heads=4, kv_heads=2, hf_layout=True, matmul_max_length=None, **kwargs):
    inputs = _inputs(lengths, heads, kv_heads, hf_layout)
    paths = {} if matmul_max_length is None else {"matmul_max_length": matmul_max_length}
    got = _run(bucketed_varlen_attention, inputs, lengths, **kwargs, **paths)
    want = _run(reference_varlen_attention, inputs, lengths, **kwargs)
    assert got[0].shape == (1, sum(lengths), heads, inputs[2].shape[3])
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


PATHS = {"default": MATMUL_MAX_LENGTH, "all_matmul": 10**6, "all_sdpa": 0}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("in_length_order", [False, True])
def test_matches_reference_across_length_mixes(mix, in_length_order, path):
    """Whether buckets are gathered (any order) or runs of the row (length order)."""
    lengths = sorted(MIXES[mix]) if in_length_order else MIXES[mix]
    _assert_matches_reference(lengths, matmul_max_length=PATHS[path])


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("hf_layout", [True, False])
def test_gqa_and_layouts(kv_heads, hf_layout, path):
    lengths = MIXES["with_ones_and_empty"] + [3, 3, 3]  # the three 3s side by side: a run of the row
    _assert_matches_reference(lengths, kv_heads=kv_heads, hf_layout=hf_layout, matmul_max_length=PATHS[path])


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("window", [1, 3, 16])
def test_sliding_window(window, path):
    lengths = MIXES["short_rl"] + MIXES["long_tailed"]
    _assert_matches_reference(lengths, window=window, matmul_max_length=PATHS[path])


@pytest.mark.parametrize("path", sorted(PATHS))
def test_not_causal_and_scaling(path):
    lengths = MIXES["with_ones_and_empty"]
    _assert_matches_reference(lengths, is_causal=False, scaling=0.3, matmul_max_length=PATHS[path])


def test_head_dims_differ():
    """D_v != D through both paths (the matmul path's matrices are [L * g, D] and [L, D_v])."""
    lengths = [5, 70, 5, 2]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, sum(lengths), 16, generator=g, requires_grad=True)
    k = torch.randn(1, 2, sum(lengths), 16, generator=g, requires_grad=True)
    v = torch.randn(1, 2, sum(lengths), 8, generator=g, requires_grad=True)
    grad = torch.randn(1, sum(lengths), 4, 8, generator=g)
    got = _run(bucketed_varlen_attention, (q, k, v, grad), lengths)
    want = _run(reference_varlen_attention, (q, k, v, grad), lengths)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_matmul_path_only_where_it_is_exact_and_fast():
    """fp32 on CPU without dropout or autocast; half precision and dropout keep sdpa (its fp32 softmax)."""
    cpu = torch.device("cpu")
    assert use_matmul_attention(torch.float32, cpu, 0.0)
    assert not use_matmul_attention(torch.bfloat16, cpu, 0.0)
    assert not use_matmul_attention(torch.float32, cpu, 0.1)
    assert not use_matmul_attention(torch.float32, torch.device("cuda"), 0.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not use_matmul_attention(torch.float32, cpu, 0.0)
    plan = plan_buckets([3, 100, 3], heads_kv=2, matmul_max_length=MATMUL_MAX_LENGTH)
    assert plan.shapes == ((2, 3), (1, 100)) and plan.matmul == (True, False)


def test_bf16_and_dropout_take_sdpa():
    lengths = MIXES["short_rl"][:20]
    q, k, v, _ = (x.detach() for x in _inputs(lengths, 4, 2, True))
    got = bucketed_varlen_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), lengths)
    want = reference_varlen_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), lengths)
    torch.testing.assert_close(got, want, atol=0, rtol=0)  # the same sdpa calls per bucket
    torch.manual_seed(0)
    dropped = bucketed_varlen_attention(q, k, v, lengths, dropout=0.5)
    assert dropped.shape == (1, sum(lengths), 4, 8) and not torch.allclose(dropped, want.float(), atol=1e-3)


def test_window_needs_causal():
    inputs = _inputs([3, 4], 2, 2, True)
    with pytest.raises(NotImplementedError, match="causal"):
        bucketed_varlen_attention(*inputs[:3], [3, 4], is_causal=False, window=2)


def test_plan_groups_segments_by_length():
    lengths = [1, 5, 0, 1, 9, 3, 1, 0, 12, 5, 5]  # 1 x3, 5 x3 (the last two side by side), 9, 3, 12
    plan = plan_buckets(lengths)
    assert plan.shapes == ((3, 1), (1, 3), (3, 5), (1, 9), (1, 12))  # one bucket per length, shortest first
    assert plan.starts == (None, 16, None, 7, 20)  # segments alone (or side by side) run on views
    assert plan.indices(0).tolist() == [0, 6, 19] and plan.indices(2).tolist()[:5] == [1, 2, 3, 4, 5]
    views = [torch.arange(s, s + c * n) for (c, n), s in zip(plan.shapes, plan.starts) if s is not None]
    covered = torch.cat([plan.gather, *views])
    assert torch.equal(covered.sort().values, torch.arange(sum(lengths)))  # every token exactly once
    assert len(plan_buckets(MIXES["short_rl"] * 10).shapes) == 9  # 960 segments of 8-16 tokens: 9 calls
    in_order = plan_buckets(sorted(MIXES["short_rl"]))
    assert all(s is not None for s in in_order.starts) and in_order.gather.numel() == 0
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        plan_buckets([3, -1])


def test_varlen_attention_dispatch_on_cpu():
    """On CPU there is no fused kernel; ``varlen_attention`` takes the bucketed path, window included."""
    lengths = MIXES["long_tailed"]
    q, k, v, _ = _inputs(lengths, 4, 2, True)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    assert fused_varlen_attention(q, k, v, cu, max(lengths), scaling=None, dropout=0.0, is_causal=True,
                                  window=None) is None
    for window in (None, 4, 10**6):
        got = varlen_attention(q, k, v, cu, sliding_window=window)
        want = reference_varlen_attention(q, k, v, lengths, window=None if window == 10**6 else window)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
