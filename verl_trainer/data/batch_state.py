"""A flat batch as plain data: its tensors and its per-sample Python objects as JSON strings.

Used where a batch leaves the process without pickle: the asynchronous rollout's queue in a checkpoint
(``algorithms/rollout_queue_state.py``) and the rollout pool's messages (``rollout_pool/channel.py``).
"""

from __future__ import annotations

import json
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict, is_non_tensor

from verl_trainer.data.schema import non_tensor_list

__all__ = ["batch_from_state", "batch_state"]


def batch_state(batch: TensorDict) -> dict[str, Any]:
    """A flat rollout batch as ``{"size", "tensors", "objects"}`` (tensors and JSON strings only).

    Raises:
        ValueError: An entry is a nested TensorDict, or a non-tensor entry holds a value JSON cannot
            encode (naming the key).
    """
    tensors: dict[str, torch.Tensor] = {}
    objects: dict[str, str] = {}
    for key in batch.keys():
        value = batch.get(key)
        if is_non_tensor(value):
            try:
                objects[key] = json.dumps(non_tensor_list(batch, key))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"batch entry {key!r} cannot be stored as plain data: its values are not "
                                 f"JSON data ({exc}); keep per-sample fields (reward fields, extra_info) to "
                                 "str/number/list/dict") from exc
        elif isinstance(value, torch.Tensor):
            tensors[key] = value.detach().to("cpu", copy=True)
        else:
            raise ValueError(f"batch entry {key!r} of type {type(value).__name__} cannot be stored as plain "
                             "data (tensors and per-sample JSON data only)")
    return {"size": int(batch.batch_size[0]), "tensors": tensors, "objects": objects}


def batch_from_state(state: dict[str, Any]) -> TensorDict:
    """The batch :func:`batch_state` stored (non-tensor entries as ``NonTensorStack``)."""
    batch = TensorDict(dict(state["tensors"]), batch_size=[int(state["size"])])
    for key, text in state["objects"].items():
        batch[key] = NonTensorStack.from_list(json.loads(text))
    return batch
