"""The router losses' aggregation kind, and the derived load imbalance.

The losses and metrics of a whole step equal across dp, micro-batching, balancing and strategy: the MoE
block of the invariance matrix (``tests/invariance/cases.py: moe_cases``).
"""

from __future__ import annotations

import math

import pytest
import torch

from verl_trainer.core_algos.aggregation import GlobalBatchInfo, agg_all_tokens_loss
from verl_trainer.data.packing import make_batch
from verl_trainer.metrics.derived import derived_metrics, expert_tokens_name


def test_all_tokens_aggregation_is_split_invariant() -> None:
    """The new kind: per-sequence token mean over every real token, mean over the real sequences."""
    batch = make_batch([[5, 6, 7], [8], [9, 10]], [[11, 12], [13, 14, 15], [16]])
    batch["is_padding"] = torch.tensor([False, False, True])
    terms = torch.arange(batch["input_ids"].numel(), dtype=torch.float32).reshape(batch["input_ids"].shape)
    whole = agg_all_tokens_loss(terms, batch)
    mask = batch["attention_mask"].bool()
    want = sum(float(terms[i][mask[i]].mean()) for i in range(2)) / 2  # the padding row counts for nothing
    assert math.isclose(float(whole), want, rel_tol=1e-6)
    info = GlobalBatchInfo(dp_size=2, batch_num_tokens=0, global_batch_size=2)
    parts = [agg_all_tokens_loss(terms[i:i + 1], batch[i:i + 1], info) for i in range(3)]
    assert math.isclose(float(sum(parts)) / 2, want, rel_tol=1e-6)  # summed over micro, mean over dp
    with pytest.raises(ValueError, match="global_batch_size"):
        agg_all_tokens_loss(terms, batch, GlobalBatchInfo(dp_size=2, batch_num_tokens=0,
                                                           global_batch_size=None))  # type: ignore[arg-type]


def test_load_imbalance_is_derived_from_the_global_totals() -> None:
    reduced = {expert_tokens_name(0, e): c for e, c in enumerate([10.0, 30.0, 20.0, 20.0])}
    reduced |= {expert_tokens_name(1, e): 20.0 for e in range(4)}
    derived = derived_metrics(reduced)
    assert derived == {"moe/layer0/load_imbalance": 1.5, "moe/layer1/load_imbalance": 1.0,
                       "moe/load_imbalance": 1.5}
    assert derived_metrics({"actor/pg_loss": 1.0}) == {}
