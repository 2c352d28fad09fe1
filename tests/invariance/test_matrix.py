"""The invariance matrix: every case reproduces its dp=1, one-micro-batch reference step to 1e-5.

Default run: the slice in ``cases.SLICE``. Whole matrix: ``pytest -m invariance tests/invariance``.
"""

from __future__ import annotations

import pytest

from tests.invariance.batch import BATCH_MULTIPLE, SEQ_LENS, UNEVEN_SIZES
from tests.invariance.cases import LIBRARY_BACKENDS, SLICE, XFAIL, Case, all_cases
from tests.invariance.compare import failures
from tests.invariance.results import MatrixResults


def case_params(slice_cases: tuple[Case, ...], every_case: list[Case]) -> list:
    """The slice marked ``invariance``; the rest also ``invariance_full`` (deselected by default); the
    known failures (``cases.XFAIL``) ``xfail(strict=True)`` with their reason; a library backend's cases
    also carry its marker (``torchtitan`` / ``megatron``: run in that backend's CI stage)."""

    def marks(case: Case, *base: pytest.MarkDecorator) -> list:
        known = XFAIL.get(case)
        library = [getattr(pytest.mark, case.strategy)] if case.strategy in LIBRARY_BACKENDS else []
        return [*base, *library, *([pytest.mark.xfail(reason=known, strict=True)] if known else [])]

    full = [pytest.mark.invariance, pytest.mark.invariance_full]
    return [pytest.param(c, id=c.id, marks=marks(c, pytest.mark.invariance)) for c in slice_cases] + [
        pytest.param(c, id=c.id, marks=marks(c, *full)) for c in every_case if c not in slice_cases
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
    # the case really ran the configuration it names, on a (dp, sp) / (dp, tp) / (pp, dp) mesh (Case.coords)
    world = case.world
    assert result["rank_mesh"] == [case.coords(r) for r in range(world)]
    assert result["rank_mp_src"] == [case.reports_outputs(r) for r in range(world)], "mp src rank"
    n = len(SEQ_LENS)
    total = n + (-n) % BATCH_MULTIPLE if case.balance else n
    assert result["rank_samples"] == [total // case.dp] * world, "equal counts on every rank"
    dp_uids = [result["rank_uids"][case.rank_of(d, 0)] for d in range(case.dp)]  # mp rank 0 of each DP rank
    for r, uids in enumerate(result["rank_uids"]):
        d = case.coords(r)[0]
        assert uids == dp_uids[d], f"rank {r}: every SP / TP / PP rank of a DP group has the same samples"
        assert result["rank_digest"][r] == result["rank_digest"][case.rank_of(d, 0)], f"rank {r}: tensors"
    assert all(m == result["rank_balance_metrics"][0] for m in result["rank_balance_metrics"])
    all_uids = sorted(u for uids in dp_uids for u in uids)
    assert all_uids == sorted(set(all_uids)) and len(all_uids) == total, "DP ranks partition the batch"
    assert set(range(n)) <= set(all_uids), "every real sample is trained on"
    assert sum(result["rank_padding"][case.rank_of(d, 0)] for d in range(case.dp)) == total - n, (
        "balancing adds the padding samples (and nothing else does)")
    samples = max(result["rank_samples"])
    want_mb = _expected_micro_batches(case, samples)
    for key in ("rank_num_micro_batches", "rank_infer_micro_batches"):
        if want_mb is not None:
            assert result[key] == [want_mb] * world, key
        else:  # dynamic: the same count on every rank, more than one micro-batch at dp=1
            assert len(set(result[key])) == 1, key
            assert case.dp > 1 or result[key][0] > 1, key
    assert not result["step_skipped"]
    assert len({tuple(sorted(m)) for m in result["rank_metrics"]}) == 1, "same metric names on every rank"
    # the invariance itself
    diffs = matrix.diffs(case)
    bad = failures(diffs)
    assert not bad, f"{case.id} differs from {case.reference().id}: {bad}"


def test_slice_is_marked_and_in_the_matrix() -> None:
    assert set(SLICE) <= set(all_cases())
    assert not set(SLICE) & set(XFAIL)
    assert {c.strategy for c in SLICE} == {"fsdp", "fsdp2", "deepspeed"}
    sp = [c for c in SLICE if c.sp > 1]
    assert len(sp) <= 1, "at most one SP case (one 4-rank spawn) in the default slice"
    assert all(c.world == 2 and c.sp == 1 for c in SLICE if c not in sp), "the rest: one spawn of 2 ranks"
    assert [c.loss for c in SLICE if c.tp > 1] == ["ppo", "ppo"], "TP cases join the 2-rank ppo spawn"
    assert [c.loss for c in SLICE if c.pp > 1] == ["ppo"], "the PP case joins the 2-rank ppo spawn"
    assert UNEVEN_SIZES[2] != [6, 6]


def test_known_failures_run_as_strict_xfail_in_their_own_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.invariance.runner import chunk_key

    known, other = Case("ppo", "token-mean", 2, "one", False, "deepspeed", sp=2), SLICE[-1]
    monkeypatch.setitem(XFAIL, known, "why it fails")
    marks = {p.values[0]: p.marks for p in case_params((other,), [known, other])}
    xfail = [m for m in marks[known] if m.name == "xfail"]
    assert len(xfail) == 1 and xfail[0].kwargs == {"reason": "why it fails", "strict": True}
    assert not [m for m in marks[other] if m.name == "xfail"]
    assert chunk_key(known) != chunk_key(Case("ppo", "token-mean", 2, "fixed1", False, "deepspeed", sp=2))
