"""``docs/metrics.md`` is what ``scripts/metrics_catalogue.py`` generates from runs of the recipes."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import metrics_catalogue  # noqa: E402


def test_the_page_lists_each_name_once_with_its_reduction_and_runs():
    runs = [("A", "run a", {"x/b": "SUM", "x/a": "MEAN"}), ("B", "run b", {"x/b": "SUM"})]
    text = metrics_catalogue.render(runs)
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert rows == ["| `x/a` | MEAN | A |", "| `x/b` | SUM | A, B |"]
    assert "- A: run a" in text


def test_one_name_with_two_reductions_is_refused():
    with pytest.raises(ValueError, match="'x' is SUM in one run and MEAN in B"):
        metrics_catalogue.render([("A", "", {"x": "SUM"}), ("B", "", {"x": "MEAN"})])


@pytest.mark.slow  # four 2-step recipe runs, about 30 s
def test_the_committed_page_is_current():
    assert (ROOT / "docs" / "metrics.md").read_text() == metrics_catalogue.page(), \
        "run python scripts/metrics_catalogue.py"
