"""Log-probs and entropy of chosen tokens from logits, in float32 chunks of tokens.

``log_softmax(logits.float())`` over ``[n, V]`` logits keeps one or more float32 ``[n, V]`` copies alive
until the backward (the log-softmax output, and for the entropy its exponential and their product); at
a vocabulary of 151,936 that is 0.6 MB per token and copy. :class:`_ChunkedLogProbs` instead runs over
``chunk`` tokens at a time: the forward keeps only the per-token ``logsumexp`` (``[n]``), and the backward
recomputes each chunk's softmax from the logits (which stay in their own dtype, e.g. bf16) — the same
formulas, so the values and gradients equal the plain float32 computation to round-off.

Gradients, per token, with ``z = logits / T``, ``p = softmax(z)``, ``H = -sum p log p``:
``d log p_y / dz = onehot(y) - p`` and ``dH / dz = -p * (log p + H)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx

CHUNK_ELEMENTS = 1 << 20
"""float32 elements of one chunk (4 MiB): ``chunk = max(1, CHUNK_ELEMENTS // V)`` tokens.

Small enough that a chunk's float32 copies stay in cache, large enough that the per-chunk overhead does not
show; ``bench/log_softmax.py`` measures the choice (docs/benchmarks.md)."""


def _chunk_rows(vocab: int, chunk_elements: int) -> int:
    return max(1, chunk_elements // max(1, vocab))


def _chunk_stats(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(log_probs [c], logsumexp [c], entropy [c] | None)`` of one chunk ``[c, V]``, float32."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, -1)
    log_probs = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        log_p = z - lse[:, None]
        entropy = -(log_p.exp() * log_p).sum(-1)
    return log_probs, lse, entropy


class _ChunkedLogProbs(torch.autograd.Function):
    """``(log_probs [n], entropy [n])`` of ``targets`` under ``logits [n, V]``, chunked over tokens."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        with_entropy: bool,
        rows: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = logits.shape[0]
        log_probs = logits.new_empty(n, dtype=torch.float32)
        lse = logits.new_empty(n, dtype=torch.float32)
        entropy = logits.new_zeros(n if with_entropy else 0, dtype=torch.float32)
        for start in range(0, n, rows):
            end = min(n, start + rows)
            lp, s, ent = _chunk_stats(logits[start:end], targets[start:end], temperature, with_entropy)
            log_probs[start:end], lse[start:end] = lp, s
            if ent is not None:
                entropy[start:end] = ent
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.temperature, ctx.rows = temperature, rows
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(
        ctx: FunctionCtx,
        grad_log_probs: torch.Tensor,
        grad_entropy: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, ...]:
        logits, targets, lse, entropy = ctx.saved_tensors
        temperature, rows = ctx.temperature, ctx.rows
        with_entropy = entropy.numel() > 0 and grad_entropy is not None
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], rows):
            end = min(logits.shape[0], start + rows)
            z = logits[start:end].float()
            if temperature != 1.0:
                z = z / temperature
            g_lp = grad_log_probs[start:end, None]
            log_p = z - lse[start:end, None]
            p = log_p.exp()
            if with_entropy:  # log_p becomes the entropy term -p * (log p + H) * dH, in place
                log_p.add_(entropy[start:end, None]).mul_(p).mul_(-grad_entropy[start:end, None])
            g = p.mul_(-g_lp)  # -p * d log p_y
            if with_entropy:
                g.add_(log_p)
            g.scatter_add_(-1, targets[start:end, None], g_lp)
            if temperature != 1.0:
                g.div_(temperature)
            grad[start:end] = g
        return grad, None, None, None, None


def chunked_log_probs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``targets[j]`` under ``logits[j]`` (and the entropy at ``j``), float32 chunk by chunk.

    Args:
        logits: ``[n, V]`` (or ``[1, n, V]``) in any float dtype; never copied whole to float32.
        targets: ``[n]`` token ids.
        temperature: Logits are divided by it first (the rollout's sampling temperature).
        calculate_entropy: Also return the entropy of each distribution.
        chunk_elements: float32 elements per chunk (tokens per chunk: ``chunk_elements // V``).

    Returns:
        ``(log_probs [n], entropy [n] | None)`` float32, per position (not shifted).

    """
    logits = logits.reshape(-1, logits.shape[-1])
    targets = targets.reshape(-1).to(device=logits.device, dtype=torch.long)
    if targets.numel() != logits.shape[0]:
        raise ValueError(f"got {targets.numel()} targets for {logits.shape[0]} rows of logits")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    rows = _chunk_rows(logits.shape[-1], chunk_elements)
    log_probs, entropy = _ChunkedLogProbs.apply(logits, targets, float(temperature), calculate_entropy, rows)
    return log_probs, entropy if calculate_entropy else None
