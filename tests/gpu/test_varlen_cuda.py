"""The packed attention kernels on CUDA (``pytest -m gpu tests/gpu``; skipped without a CUDA device).

bf16 on CUDA runs a fused kernel (flash-attn when installed, else ``torch.nn.attention.varlen.varlen_attn``
where torch has it); fp32 runs the bucketed sdpa path. Each is compared with the per-segment reference,
forward and gradients, at bf16 (resp. fp32) tolerance.
"""

import pytest
import torch

from verl_trainer.models.attention import varlen_attention
from verl_trainer.models.varlen_kernels import (
    flash_attn_varlen_func,
    fused_varlen_attention,
    reference_varlen_attention,
    torch_varlen_attn,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LENGTHS = [37, 1, 300, 64, 5, 250, 1, 16]


def _inputs(dtype, heads=8, kv_heads=2, dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(LENGTHS)

    def leaf(h):
        x = torch.randn(1, n, h, dim, generator=g).to("cuda", dtype)
        return x.transpose(1, 2).requires_grad_(True)

    grad = torch.randn(1, n, heads, dim, generator=g).to("cuda", dtype)
    return leaf(heads), leaf(kv_heads), leaf(kv_heads), grad


def _fwd_bwd(fn, inputs):
    q, k, v, grad = inputs
    for x in (q, k, v):
        x.grad = None
    out = fn(q, k, v)
    out.backward(grad)
    return [t.float() for t in (out.detach(), q.grad, k.grad, v.grad)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 32])
def test_varlen_attention_cuda_matches_reference(dtype, window):
    inputs = _inputs(dtype)
    cu = torch.tensor([0, *LENGTHS], device="cuda").cumsum(0).to(torch.int32)
    got = _fwd_bwd(lambda q, k, v: varlen_attention(q, k, v, cu, sliding_window=window), inputs)
    want = _fwd_bwd(lambda q, k, v: reference_varlen_attention(q, k, v, LENGTHS, window=window), inputs)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_a_fused_kernel_runs_in_bf16():
    """With flash-attn or a torch that has ``varlen_attn``, bf16 never falls back to the bucketed path."""
    if flash_attn_varlen_func() is None and torch_varlen_attn() is None:
        pytest.skip("neither flash-attn nor torch.nn.attention.varlen.varlen_attn is available")
    q, k, v, _ = _inputs(torch.bfloat16)
    cu = torch.tensor([0, *LENGTHS], device="cuda").cumsum(0).to(torch.int32)
    kwargs = {"scaling": None, "dropout": 0.0, "is_causal": True, "window": None}
    out = fused_varlen_attention(q, k, v, cu, max(LENGTHS), **kwargs)
    assert out is not None and out.shape == (1, sum(LENGTHS), 8, 64)
