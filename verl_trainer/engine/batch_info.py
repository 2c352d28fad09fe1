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

from dataclasses import dataclass


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
