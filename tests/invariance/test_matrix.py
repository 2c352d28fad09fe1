"""The invariance matrix: every case reproduces its dp=1, one-micro-batch reference step to 1e-5.

Default run: the slice in ``cases.SLICE``. Whole matrix: ``pytest -m invariance tests/invariance``.
"""

from __future__ import annotations

import pytest

from tests.invariance.batch import BATCH_MULTIPLE, SEQ_LENS, UNEVEN_SIZES
from tests.invariance.cases import SLICE, Case, all_cases
from tests.invariance.compare import failures
from tests.invariance.results import MatrixResults


def case_params(slice_cases: tuple[Case, ...], every_case: list[Case]) -> list:
    """The slice marked ``invariance``; the rest also ``invariance_full`` (deselected by default)."""
    full = [pytest.mark.invariance, pytest.mark.invariance_full]
    return [pytest.param(c, id=c.id, marks=pytest.mark.invariance) for c in slice_cases] + [
        pytest.param(c, id=c.id, marks=full) for c in every_case if c not in slice_cases
    ]


def _skip_unavailable(case: Case) -> None:
    if not MatrixResults.available(case):
        pytest.skip(f"{case.strategy} backend not available")


def _expected_micro_batches(case: Case, samples: int) -> int | None:
    """Micro-batches each rank must run (None: dynamic, checked separately)."""
    return {"one": 1, "fixed1": samples, "fixed2": -(-samples // 2)}.get(case.micro)


@pytest.mark.parametrize("case", case_params(SLICE, all_cases()))
def test_case_matches_reference(case: Case, matrix: MatrixResults) -> None:
    _skip_unavailable(case)
    result = matrix.result(case)
    # the case really ran the configuration it names
    n = len(SEQ_LENS)
    if case.balance:
        total = n + (-n) % BATCH_MULTIPLE
        assert result["rank_samples"] == [total // case.dp] * case.dp, "balancing: equal counts"
        assert sum(result["rank_padding"]) == total - n, "balancing adds the padding samples"
    else:
        assert result["rank_samples"] == [n // case.dp] * case.dp
    samples = max(result["rank_samples"])
    want_mb = _expected_micro_batches(case, samples)
    if want_mb is not None:
        assert result["rank_micro_batches"] == [want_mb] * case.dp
    else:  # dynamic: the same count on every rank, more than one micro-batch at dp=1
        assert len(set(result["rank_micro_batches"])) == 1
        assert case.dp > 1 or result["num_micro_batches"] > 1
    assert not result["step_skipped"]
    assert len({tuple(sorted(m)) for m in result["rank_metrics"]}) == 1, "same metric names on every rank"
    # the invariance itself
    diffs = matrix.diffs(case)
    bad = failures(diffs)
    assert not bad, f"{case.id} differs from {case.reference().id}: {bad}"


def test_slice_is_marked_and_in_the_matrix() -> None:
    assert set(SLICE) <= set(all_cases())
    assert {c.strategy for c in SLICE} == {"fsdp", "fsdp2", "deepspeed"}
    assert all(c.dp == 2 for c in SLICE), "the slice runs on one spawn of 2 ranks"
    assert UNEVEN_SIZES[2] != [6, 6]
