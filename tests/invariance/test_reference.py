"""The references themselves are right: the dp=1, one-micro-batch engine step equals a plain PyTorch step.

Plain PyTorch (``plain.py``): the HF model (sdpa, padded batch, no packing) on the whole batch, the same
loss function with the whole batch's denominators, ``loss.backward()``, ``clip_grad_norm_`` and
``torch.optim.AdamW``. So the matrix compares every case with a step that is correct, not merely
self-consistent.
"""

from __future__ import annotations

import pytest
from tensordict import TensorDict

from tests.invariance.cases import (
    AGG_MODES,
    CORRECTION_AGG_MODES,
    CORRECTION_LOSS,
    LOSSES,
    MULTI_TURN_AGG_MODES,
    MULTI_TURN_LOSS,
    SLICE,
    VERSION_LOSS,
    Case,
)
from tests.invariance.compare import compare, failures
from tests.invariance.plain import plain_step
from tests.invariance.results import MatrixResults

SLICE_REFS = {(c.loss, c.agg) for c in SLICE}


def reference_params() -> list:
    """Every reference; the two the default slice needs anyway run by default, the rest with the full."""
    params = []
    pairs = [(loss, agg) for loss in LOSSES for agg in AGG_MODES]
    pairs += [(CORRECTION_LOSS, agg) for agg in CORRECTION_AGG_MODES]
    pairs += [(MULTI_TURN_LOSS, agg) for agg in MULTI_TURN_AGG_MODES]
    pairs += [(VERSION_LOSS, agg) for agg in ("token-mean", "seq-mean-token-mean")]  # the version fields
    for loss, agg in pairs:
        case = Case(loss, agg, 1, "one", False, "fsdp2")
        marks = [pytest.mark.invariance]
        if (loss, agg) not in SLICE_REFS:
            marks.append(pytest.mark.invariance_full)
        params.append(pytest.param(case, id=case.id, marks=marks))
    return params


@pytest.mark.parametrize("case", reference_params())
def test_reference_matches_plain_pytorch(case: Case, matrix: MatrixResults, invariance_model: str,
                                         invariance_batch: TensorDict) -> None:
    assert case.is_reference
    engine = matrix.result(case)
    plain = plain_step(case, invariance_model, invariance_batch)
    diffs = compare(engine, plain, matrix.before(case.model_type))
    bad = failures(diffs)
    assert not bad, f"engine reference {case.id} differs from plain PyTorch: {bad}"
