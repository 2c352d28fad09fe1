"""Log-probs and entropy from vocabulary-parallel logits, without gathering the full ``[n, V]`` logits.

Under tensor parallelism each TP rank holds the logits of its own slice of token ids
(``engine/tensor_parallel.py: vocab_slice_start``). :class:`_VocabParallelLogProbs` reduces them with
all-reduces of ``[n]`` vectors over the TP group (the max, the sum of exponentials, the target's logit; a
fourth for the entropy); its backward needs no communication.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx


class _VocabParallelLogProbs(torch.autograd.Function):
    """``(log_probs [n], entropy [n])`` of global ``targets`` under this rank's vocabulary slice."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        vocab_start: int,
        group: dist.ProcessGroup,
        temperature: float,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        z = logits.float()
        if temperature != 1.0:
            z = z / temperature
        local_max = z.max(-1).values
        dist.all_reduce(local_max, dist.ReduceOp.MAX, group=group)
        shifted = z - local_max[:, None]
        exp = shifted.exp()
        sum_exp = exp.sum(-1)
        dist.all_reduce(sum_exp, group=group)
        lse = local_max + sum_exp.log()
        local = targets - vocab_start
        mine = (local >= 0) & (local < z.shape[-1])
        target_logit = z.gather(-1, local.clamp(0, z.shape[-1] - 1)[:, None]).squeeze(-1) * mine
        dist.all_reduce(target_logit, group=group)
        log_probs = target_logit - lse
        entropy = z.new_zeros(z.shape[0] if with_entropy else 0)
        if with_entropy:  # H = sum_v p_v (lse - z_v): non-negative terms, no cancellation
            entropy = (exp * (lse[:, None] - z)).sum(-1) / sum_exp
            dist.all_reduce(entropy, group=group)
        ctx.save_for_backward(logits, local, mine, lse, entropy)
        ctx.temperature = temperature
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(
        ctx: FunctionCtx,
        grad_log_probs: torch.Tensor,
        grad_entropy: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, ...]:
        # local to each rank's slice, with z = logits / T, lse the global log-sum-exp and p = exp(z - lse):
        # d log p_y / dz = onehot(y) - p and dH / dz = -p * (log p + H); DTensor's backward then sums the
        # gradient reaching the head's replicated input over TP
        logits, local, mine, lse, entropy = ctx.saved_tensors
        temperature = ctx.temperature
        z = logits.float()
        if temperature != 1.0:
            z = z / temperature
        log_p = z - lse[:, None]
        p = log_p.exp()
        grad = p * -grad_log_probs[:, None]
        onehot_grad = (grad_log_probs * mine)[:, None]
        grad.scatter_add_(-1, local.clamp(0, z.shape[-1] - 1)[:, None], onehot_grad)
        if entropy.numel() and grad_entropy is not None:
            grad -= p * (log_p + entropy[:, None]) * grad_entropy[:, None]
        if temperature != 1.0:
            grad /= temperature
        return grad.to(logits.dtype), None, None, None, None, None


def vocab_parallel_log_probs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    group: dist.ProcessGroup,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``targets[j]`` (and the entropy at ``j``) from this rank's slice of the logits.

    A collective over ``group`` (every TP rank calls it with its own slice and the same targets).

    Args:
        logits: ``[n, V / tp]`` (or ``[1, n, V / tp]``): logits of tokens ``vocab_start ..`` on this rank.
        targets: ``[n]`` global token ids (the same on every TP rank).
        vocab_start: First token id of this rank's slice.
        group: The TP process group.
        temperature: Logits are divided by it first.
        calculate_entropy: Also return the entropy of each distribution.

    Returns:
        ``(log_probs [n], entropy [n] | None)`` float32, equal on every TP rank.

    """
    logits = logits.reshape(-1, logits.shape[-1])
    targets = targets.reshape(-1).to(device=logits.device, dtype=torch.long)
    if targets.numel() != logits.shape[0]:
        raise ValueError(f"got {targets.numel()} targets for {logits.shape[0]} rows of logits")
    log_probs, entropy = _VocabParallelLogProbs.apply(
        logits, targets, int(vocab_start), group, float(temperature), calculate_entropy
    )
    return log_probs, entropy if calculate_entropy else None
