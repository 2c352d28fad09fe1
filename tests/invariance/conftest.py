"""Fixtures of the invariance matrix: the tiny model, the fixed batch and the lazily run results.

The results fixture looks at the tests this session selected (``request.session.items``) and runs only
the cases they need, chunk by chunk — the default run pays for the slice only.
"""

from __future__ import annotations

import pytest

from tests.engine.common import tiny_model
from tests.invariance.batch import make_invariance_batch
from tests.invariance.cases import Case
from tests.invariance.results import MatrixResults


@pytest.fixture(scope="session")
def invariance_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model(str(tmp_path_factory.mktemp("invariance") / "model"))


@pytest.fixture(scope="session")
def invariance_batch(invariance_model: str):
    return make_invariance_batch(invariance_model)


def _selected_cases(session: pytest.Session) -> list[Case]:
    cases = set()
    for item in session.items:
        callspec = getattr(item, "callspec", None)
        for value in (callspec.params.values() if callspec else ()):
            if isinstance(value, Case):
                cases.add(value)
    return sorted(cases)


@pytest.fixture(scope="session")
def matrix(request: pytest.FixtureRequest, invariance_model: str, invariance_batch) -> MatrixResults:
    cases = [c for c in _selected_cases(request.session) if MatrixResults.available(c)]
    return MatrixResults(invariance_model, invariance_batch, cases)
