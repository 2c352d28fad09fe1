"""HF-style batches at the Trainer's boundary: ``{input_ids, attention_mask, labels}`` → the schema.

A Lightning / transformers user's DataModule often yields what HF collators produce
(``DataCollatorForLanguageModeling``, ``DataCollatorForSeq2Seq``, a tokenizer's ``BatchEncoding``): a dict of
``input_ids [B, T]``, ``attention_mask [B, T]`` and ``labels [B, T]`` with ``-100`` on positions that are not
trained. :func:`to_schema_batch` turns that into the schema batch (``data/schema.py``) the engines take:
rows right-aligned to start at column 0 (left padding is undone), ``loss_mask[t] = labels[t] != -100``
(schema convention: token ``t`` is a trained target, predicted from the tokens before it; position 0 is
never a target), ``uid`` per row, lengths and position ids. A ``TensorDict`` passes through; any other
mapping, or labels that are not the input ids (shifted labels), is a :class:`~verl_trainer.data.schema.
BatchSchemaError` naming what was found and what is expected.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict

from verl_trainer.data import schema
from verl_trainer.data.packing import make_batch
from verl_trainer.data.schema import BatchSchemaError

__all__ = ["IGNORE_INDEX", "from_hf_batch", "to_schema_batch"]

IGNORE_INDEX = -100
"""The label HF losses ignore."""

_HF_KEYS = ("input_ids", "attention_mask", "labels")


def _tensor(batch: Mapping[str, Any], key: str) -> torch.Tensor:
    value = batch[key]
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    if t.dim() != 2:
        raise BatchSchemaError(f"HF batch {key!r} must be [B, T], got shape {tuple(t.shape)}")
    return t.long()


def from_hf_batch(batch: Mapping[str, Any], pad_token_id: int = 0) -> TensorDict:
    """The schema batch of an HF-style ``{input_ids, attention_mask?, labels?}`` dict.

    Args:
        batch: ``input_ids [B, T]``; ``attention_mask [B, T]`` (default: all ones); ``labels [B, T]`` with
            ``-100`` where not trained (default: every real token after the first is trained).
        pad_token_id: Id written at padding positions.

    Returns:
        A schema ``TensorDict`` ``[B, T']`` (``make_batch``'s keys), ``loss_mask`` from the labels.

    Raises:
        BatchSchemaError: Missing ``input_ids``, mismatched shapes, a non-contiguous attention mask, or
            labels that differ from the input ids where they are not ``-100``.
    """
    if "input_ids" not in batch:
        raise BatchSchemaError(
            f"a dict batch needs 'input_ids' (HF style: input_ids, attention_mask, labels); got keys "
            f"{sorted(batch)}. Return a TensorDict built with verl_trainer.data.packing.make_batch, or HF "
            "keys"
        )
    ids = _tensor(batch, "input_ids")
    has_mask, has_labels = batch.get("attention_mask") is not None, batch.get("labels") is not None
    mask = _tensor(batch, "attention_mask") if has_mask else torch.ones_like(ids)
    labels = _tensor(batch, "labels") if has_labels else torch.where(mask.bool(), ids, IGNORE_INDEX)
    if mask.shape != ids.shape or labels.shape != ids.shape:
        raise BatchSchemaError(
            f"HF batch shapes differ: input_ids {tuple(ids.shape)}, attention_mask {tuple(mask.shape)}, "
            f"labels {tuple(labels.shape)}"
        )
    trained = (labels != IGNORE_INDEX) & mask.bool()
    if (labels[trained] != ids[trained]).any():
        raise BatchSchemaError(
            "HF batch labels differ from input_ids where they are not -100; the engine shifts internally, "
            "so give labels aligned with input_ids (labels = input_ids, -100 where not trained), as "
            "DataCollatorForLanguageModeling(mlm=False) does, not pre-shifted labels"
        )
    rows, targets = [], []
    for i in range(ids.shape[0]):
        real = mask[i].bool().nonzero().flatten()
        if real.numel() and int(real[-1] - real[0]) + 1 != real.numel():
            raise BatchSchemaError(
                f"HF batch row {i}: attention_mask has holes; only left or right padding is supported"
            )
        rows.append(ids[i, real].tolist())
        targets.append(trained[i, real])
    out = make_batch([[] for _ in rows], rows, pad_token_id=pad_token_id)
    loss = torch.zeros_like(out[schema.LOSS_MASK])
    for i, t in enumerate(targets):
        loss[i, : t.numel()] = t.float()
    loss[:, 0] = 0.0  # position 0 has no prediction
    out[schema.LOSS_MASK] = loss
    out[schema.RESPONSE_MASK] = loss.clone()
    return out


def to_schema_batch(batch: Any) -> Any:
    """``batch`` as a schema batch at the Trainer's boundary.

    A ``TensorDict`` passes through; a mapping is read as an HF batch (:func:`from_hf_batch`); any other
    object (a module's own batch type) passes through unchanged for the module to handle.

    Raises:
        BatchSchemaError: A mapping that is not an HF batch (the message lists its keys).
    """
    if isinstance(batch, TensorDict) or not isinstance(batch, Mapping):
        return batch
    return from_hf_batch(batch)
