"""``docs/benchmarks.md`` is what ``scripts/benchmarks_page.py`` generates from ``bench/results/``."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import benchmarks_page  # noqa: E402


def test_the_committed_page_is_current():
    assert (ROOT / "docs" / "benchmarks.md").read_text() == benchmarks_page.page(), \
        "run python scripts/benchmarks_page.py"


def test_every_stored_result_has_a_section_and_the_history_follows():
    text = benchmarks_page.page()
    for name, *_ in (*benchmarks_page.SECTIONS, *benchmarks_page.TABLES):
        if (benchmarks_page.RESULTS / name).exists():
            assert f"bench/results/{name}" in text
    assert "Other result files" not in text
    assert text.index("## Stored results") < text.index("## Recorded measurements")


def test_a_step_throughput_result_renders_its_ratio_and_sides():
    side = {"median_s": 1.0, "tokens_per_s": 100.0, "mfu_fp32": 0.5, "micro_batches": 2}
    result = {"dtype": "fp32", "tokens": 100, "device": "cpu", "safe_baseline": "padded",
              "ratio_vs_safe": 2.0,
              "sides": {"ours": side}}
    text = benchmarks_page.step_throughput(result)
    assert "**2.00x**" in text and "| ours | 1.00 | 100 | 50.0% | 2 |" in text
