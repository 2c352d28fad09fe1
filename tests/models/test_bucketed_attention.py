"""The bucketed varlen attention (CPU path) equals the per-segment reference, forward and gradients."""

import pytest
import torch

from verl_trainer.models.attention import varlen_attention
from verl_trainer.models.bucketed_attention import bucketed_varlen_attention, plan_buckets
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


def _assert_matches_reference(lengths, heads=4, kv_heads=2, hf_layout=True, **kwargs):
    inputs = _inputs(lengths, heads, kv_heads, hf_layout)
    got = _run(bucketed_varlen_attention, inputs, lengths, **kwargs)
    want = _run(reference_varlen_attention, inputs, lengths, **kwargs)
    assert got[0].shape == (1, sum(lengths), heads, inputs[2].shape[3])
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("in_length_order", [False, True])
def test_matches_reference_across_length_mixes(mix, in_length_order):
    """Whether buckets are gathered (any order) or views of the row (length order)."""
    _assert_matches_reference(sorted(MIXES[mix]) if in_length_order else MIXES[mix])


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("hf_layout", [True, False])
def test_gqa_and_layouts(kv_heads, hf_layout):
    _assert_matches_reference(MIXES["with_ones_and_empty"], kv_heads=kv_heads, hf_layout=hf_layout)


@pytest.mark.parametrize("window", [1, 3, 16])
def test_sliding_window(window):
    _assert_matches_reference(MIXES["short_rl"] + MIXES["long_tailed"], window=window)


def test_not_causal_and_scaling():
    _assert_matches_reference(MIXES["with_ones_and_empty"], is_causal=False, scaling=0.3)


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
