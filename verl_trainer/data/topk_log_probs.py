"""A distribution's top-k tokens and log-probs, and log-probs of given ids, from logits in float32 chunks.

The two halves of top-k distillation (:mod:`verl_trainer.core_algos.distill`):

* :func:`topk_log_probs` (the teacher, no gradient): per position the ``k`` most likely ids of
  ``softmax(logits / T)`` and their log-probs (``log p = z_id - logsumexp(z)``, ``z = logits / T``);
* :func:`gathered_log_probs` (the student, with gradient): per position the log-probs of ``k`` given ids
  under ``softmax(logits / T)``.

Both run over ``chunk`` rows at a time (``log_probs.CHUNK_ELEMENTS`` float32 elements), so no float32
``[n, V]`` copy exists; :func:`gathered_log_probs` recomputes each chunk in the backward
(``torch.utils.checkpoint``), so it keeps only the logits (in their own dtype) until then.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from verl_trainer.data.log_probs import CHUNK_ELEMENTS

__all__ = ["gathered_log_probs", "topk_log_probs"]


def _rows(vocab: int, chunk_elements: int) -> int:
    return max(1, chunk_elements // max(1, vocab))


def _check(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return logits.reshape(-1, logits.shape[-1])


@torch.no_grad()
def topk_log_probs(logits: torch.Tensor, k: int, temperature: float = 1.0,
                   chunk_elements: int = CHUNK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely ids per row and their log-probs (no gradient).

    Args:
        logits: ``[n, V]`` (or ``[1, n, V]``), any float dtype.
        k: Ids per row, ``1 <= k <= V``.
        temperature: Logits are divided by it first.
        chunk_elements: float32 elements per chunk.

    Returns:
        ``(ids [n, k] long, log_probs [n, k] float32)``, most likely first.

    Raises:
        ValueError: ``k`` outside ``[1, V]`` or ``temperature <= 0``.
    """
    logits = _check(logits, temperature)
    vocab = logits.shape[-1]
    if not 1 <= k <= vocab:
        raise ValueError(f"top_k={k} must be in [1, vocab size {vocab}]")
    ids, values = [], []
    for chunk in torch.split(logits, _rows(vocab, chunk_elements)):
        z = chunk.float() / temperature
        top, idx = torch.topk(z, k, dim=-1)
        values.append(top - torch.logsumexp(z, -1, keepdim=True))
        ids.append(idx)
    if not ids:
        return logits.new_zeros((0, k), dtype=torch.long), logits.new_zeros((0, k), dtype=torch.float32)
    return torch.cat(ids), torch.cat(values)


def _gather_chunk(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    z = logits.float() / temperature
    return z.gather(-1, ids) - torch.logsumexp(z, -1, keepdim=True)


def gathered_log_probs(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0,
                       chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """``log softmax(logits / T)[row, ids[row, j]]`` with its gradient, chunked over rows.

    Args:
        logits: ``[n, V]`` (or ``[1, n, V]``), any float dtype.
        ids: ``[n, k]`` token ids in ``[0, V)``.
        temperature: Logits are divided by it first.
        chunk_elements: float32 elements per chunk.

    Returns:
        ``[n, k]`` float32.

    Raises:
        ValueError: ``ids`` is not ``[n, k]`` for the ``n`` rows of ``logits``, or ``temperature <= 0``.
    """
    logits = _check(logits, temperature)
    ids = ids.to(device=logits.device, dtype=torch.long)
    if ids.dim() != 2 or ids.shape[0] != logits.shape[0]:
        raise ValueError(f"ids of shape {tuple(ids.shape)} for {logits.shape[0]} rows of logits; "
                         "expected [n, k]")
    rows = _rows(logits.shape[-1], chunk_elements)
    parts = []
    for chunk, chunk_ids in zip(torch.split(logits, rows), torch.split(ids, rows)):
        if torch.is_grad_enabled() and chunk.requires_grad:
            parts.append(checkpoint(_gather_chunk, chunk, chunk_ids, temperature, use_reentrant=False))
        else:
            parts.append(_gather_chunk(chunk, chunk_ids, temperature))
    if not parts:
        return logits.new_zeros(ids.shape, dtype=torch.float32)
    return torch.cat(parts)
