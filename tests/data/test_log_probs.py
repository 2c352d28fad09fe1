"""Chunked log-probs / entropy equal the plain float32 log-softmax, forward and gradients."""

import pytest
import torch

from verl_trainer.data.log_probs import chunked_log_probs_and_entropy


def _plain(logits, targets, temperature):
    log_p = torch.log_softmax(logits.float() / temperature, -1)
    return log_p.gather(-1, targets[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


@pytest.mark.parametrize("chunk_elements", [1, 3 * 50, 10**9])  # one token per chunk; 3; one chunk
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_plain(chunk_elements, temperature):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(11, 50, generator=g)).requires_grad_(True)
    targets = torch.randint(0, 50, (11,), generator=g)
    w_lp, w_ent = torch.randn(11, generator=g), torch.randn(11, generator=g)
    lp, ent = chunked_log_probs_and_entropy(logits, targets, temperature, True, chunk_elements)
    (lp @ w_lp + ent @ w_ent).backward()
    got_grad, logits.grad = logits.grad, None
    want_lp, want_ent = _plain(logits, targets, temperature)
    (want_lp @ w_lp + want_ent @ w_ent).backward()
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_grad, logits.grad, atol=1e-6, rtol=1e-5)


def test_log_probs_only_and_bf16_logits():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 6, 40, generator=g).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, 40, (1, 6), generator=g)
    lp, ent = chunked_log_probs_and_entropy(logits, targets, chunk_elements=80)
    assert ent is None and lp.dtype == torch.float32 and lp.shape == (6,)
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    ref = logits.detach().float().requires_grad_(True)
    want = _plain(ref[0], targets[0], 1.0)[0]
    want.sum().backward()
    torch.testing.assert_close(lp, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits.grad.float(), ref.grad, atol=1e-2, rtol=1e-2)  # bf16 rounding


def test_errors():
    with pytest.raises(ValueError, match="targets"):
        chunked_log_probs_and_entropy(torch.zeros(3, 5), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        chunked_log_probs_and_entropy(torch.zeros(3, 5), torch.zeros(3, dtype=torch.long), temperature=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 16, 63, 64])  # tokens per chunk; 64: one chunk of all
def test_every_chunk_size_equals_one_unchunked_float32_reference(rows, dtype):
    """The chunk sizes ``bench/log_softmax.py`` compares compute the same values and gradients."""
    n, vocab = 64, 1000
    g = torch.Generator().manual_seed(2)
    logits = (3 * torch.randn(n, vocab, generator=g)).to(dtype).requires_grad_(True)
    targets = torch.randint(0, vocab, (n,), generator=g)
    w_lp, w_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    lp, ent = chunked_log_probs_and_entropy(logits, targets, 0.7, True, rows * vocab)
    (lp @ w_lp + ent @ w_ent).backward()
    ref = logits.detach().float().requires_grad_(True)
    want_lp, want_ent = _plain(ref, targets, 0.7)
    (want_lp @ w_lp + want_ent @ w_ent).backward()
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(logits.grad, ref.grad, atol=1e-6, rtol=1e-5)
    else:  # computed in float32 and rounded once to bfloat16: within one bf16 step of the reference
        torch.testing.assert_close(logits.grad.float(), ref.grad, atol=1e-6, rtol=2**-8)
