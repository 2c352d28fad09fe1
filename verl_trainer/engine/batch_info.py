"""The contract between the engine and a loss function.

The engine calls ``loss_fn(model_output, micro_batch, info)`` once per micro-batch and expects
``(loss, metrics)`` back:

* ``model_output``: ``dict[str, Tensor]``, each ``[b, t]`` with the same shape as
  ``micro_batch["input_ids"]`` and aligned with it (DESIGN: next-token convention,
  ``log_probs[:, i] = log p(input_ids[:, i] | input_ids[:, :i])``; position 0 and padding hold 0).
  Keys: ``"log_probs"`` and, when asked, ``"entropy"`` (language model); ``"values"`` (value model).
* ``micro_batch``: the micro-batch ``TensorDict`` (padded ``[b, t]``; see ``verl_trainer.data.schema``).
* ``info``: :class:`GlobalBatchInfo`, the global denominators of the whole optimizer step, computed
  by the engine **before** splitting into micro-batches.
* ``loss``: a scalar tensor that is the micro-batch's *partial* contribution: normalised by the
  global denominators and multiplied by ``dp_size`` (the data-parallel gradient average divides by
  it again). The engine calls ``loss.backward()`` as is — never divided by the micro-batch count.
* ``metrics``: ``dict[str, verl_trainer.metrics`` values that declare their reduction ``]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from verl_trainer.data import schema
from verl_trainer.utils.distributed import all_reduce


@dataclass(frozen=True)
class GlobalBatchInfo:
    """Global denominators of one optimizer step, identical on every rank.

    Attributes:
        dp_size: Data-parallel world size (world_size // sp_size).
        batch_num_tokens: Sum of ``loss_mask`` over the whole step on all DP ranks.
        global_batch_size: Number of real (``is_padding == False``) samples in the step on all DP
            ranks.
        dp_rank: This rank's data-parallel rank.
    """

    dp_size: int
    batch_num_tokens: int
    global_batch_size: int
    dp_rank: int = 0

    @classmethod
    def from_batch(cls, data: Mapping[str, Any] | Any) -> GlobalBatchInfo:
        """The denominators of ``data`` alone: one process, one micro-batch (``dp_size = 1``).

        The same definitions the engine all-reduces (:func:`local_counts`), so a loss function called
        without info agrees with the engine on a single-process, single-micro-batch step.
        """
        counts = local_counts(data)
        return cls(dp_size=1, batch_num_tokens=int(round(float(counts[0]))),
                   global_batch_size=int(round(float(counts[1]))))


def loss_mask_of(data: Mapping[str, Any] | Any) -> torch.Tensor:
    """Return the ``[B, T]`` mask whose sum is ``batch_num_tokens``.

    ``loss_mask``, else ``response_mask``, else ``attention_mask``.
    """
    for key in (schema.LOSS_MASK, schema.RESPONSE_MASK, schema.ATTENTION_MASK):
        if key in data.keys():
            return data[key]
    raise KeyError(f"the batch has none of {schema.LOSS_MASK!r}, {schema.RESPONSE_MASK!r}, "
                   f"{schema.ATTENTION_MASK!r}; cannot count its loss tokens")


def local_counts(data: Mapping[str, Any] | Any) -> torch.Tensor:
    """``[2]`` float64 CPU: (loss-mask tokens, real samples) of this rank's batch.

    Real samples are those with ``is_padding == False`` — every row when the tag is absent. A real
    sample whose loss mask is all zero counts: ``seq-mean-*`` modes average over the step's samples
    (DESIGN §6: rows with no token contribute 0 to the numerator, 1 to the denominator).
    """
    mask = loss_mask_of(data)
    num_tokens = mask.to(torch.float64).sum().cpu()
    num_samples = torch.tensor(float(schema.num_real(data)), dtype=torch.float64)
    return torch.stack([num_tokens, num_samples])


def compute_global_batch_info(
    data: Mapping[str, Any] | Any, dp_group: dist.ProcessGroup | None, dp_size: int, dp_rank: int
) -> GlobalBatchInfo:
    """Global denominators of one optimizer step (one all-reduce of two numbers over the DP group).

    Args:
        data: This DP rank's whole batch ``[B, T]``, before splitting.
        dp_group: The DP group (``None``: single process).
        dp_size: DP world size.
        dp_rank: This rank's DP rank.

    Returns:
        ``GlobalBatchInfo(dp_size, batch_num_tokens, global_batch_size, dp_rank)``.

    """
    counts = local_counts(data)
    if dp_group is not None and dp_size > 1:
        counts = all_reduce(counts, dp_group)
    return GlobalBatchInfo(
        dp_size=dp_size,
        batch_num_tokens=int(round(float(counts[0]))),
        global_batch_size=int(round(float(counts[1]))),
        dp_rank=dp_rank,
    )
