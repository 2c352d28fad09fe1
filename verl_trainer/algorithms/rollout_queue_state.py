"""The asynchronous rollout's queue in a checkpoint: the generated groups, as tensors and plain data.

A checkpoint of step ``s`` written with ``max_staleness = k`` holds, per rank, the groups of steps
``s .. s + k - 1`` already admitted (sampled with the weights after ``s - k .. s - 1`` updates). Saving
their *samples* is exact and the cheapest choice: a few token tensors per step instead of ``k`` copies of
the weights plus a regeneration on resume. The checkpoint waits for the queued groups to finish (that
step loses its overlap), then each group is stored as

* ``tensors``: every tensor entry of its rollout batch (token ids, masks, behaviour log-probs, versions);
* ``objects``: every non-tensor entry (reward fields, response text) as one JSON string per key.

so ``trainer_state.pt`` still loads with ``torch.load(weights_only=True)`` (nothing is unpickled). The
ranks' queues are gathered to rank 0's state (a collective inside the module's ``state_dict``, which every
rank calls) and each rank takes its own back on resume; a resume at another world size or another
``max_staleness`` / ``partial_rollout`` drops them (the groups are generated again, with the restored
weights).
"""

from __future__ import annotations

from typing import Any

from verl_trainer.utils.distributed import all_gather_object, get_rank, get_world_size

__all__ = ["QUEUE_STATE_VERSION", "gather_queue_states", "own_queue_state"]

QUEUE_STATE_VERSION = 1
"""The layout of one rank's queue state (:meth:`AsyncRollout.state_dict`)."""


def gather_queue_states(local: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's queue state, in global rank order (a collective over the world)."""
    return list(all_gather_object(local))  # type: ignore[arg-type]


def own_queue_state(saved: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """This rank's entry of :func:`gather_queue_states`' list (``None``: none, or another world size)."""
    if not saved or len(saved) != get_world_size():
        return None
    state = saved[get_rank()]
    return state if state.get("version") == QUEUE_STATE_VERSION else None
