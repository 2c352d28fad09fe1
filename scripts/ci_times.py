"""Where a CI run's time went: per stage, from the pytest logs that ``.ci/run`` writes under ``$CI_LOGS``.

Usage: ``python scripts/ci_times.py CI_LOGS_DIR [--top N]``

For each ``STAGE.log`` it prints the stage's pytest summary (tests, seconds) and, from the
``--durations`` table in the log, the test files that took the most (setup, call and teardown together),
with the share of the stage each holds. Stages whose log has several pytest runs (``vllm``, ``ray``) add
their runs up. The durations table lists only the slowest tests, so the per-file times are lower bounds.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

SUMMARY = re.compile(r"^=*\s*(?P<counts>\d+ (?:passed|failed).*?) in (?P<secs>[\d.]+)s")
DURATION = re.compile(r"^(?P<secs>[\d.]+)s (?P<when>setup|call|teardown)\s+(?P<node>\S+)")


def stage_times(log: Path) -> tuple[float, list[str], dict[str, float]]:
    """``(seconds of its pytest runs, their count lines, seconds per test file from the durations)``."""
    total, counts, per_file = 0.0, [], defaultdict(float)
    for line in log.read_text(errors="replace").splitlines():
        if m := SUMMARY.match(line.strip()):
            total += float(m["secs"])
            counts.append(m["counts"])
        elif m := DURATION.match(line.strip()):
            per_file[m["node"].split("::")[0]] += float(m["secs"])
    return total, counts, per_file


def main() -> None:
    """Print every stage of the CI_LOGS directory given on the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", type=Path, help="the CI_LOGS directory of a .ci/run")
    parser.add_argument("--top", type=int, default=8, help="test files listed per stage")
    args = parser.parse_args()
    for log in sorted(args.logs.glob("*.log")):
        total, counts, per_file = stage_times(log)
        print(f"{log.stem:<16} {total:7.0f} s  {'; '.join(counts) or 'no pytest summary'}")
        for path, secs in sorted(per_file.items(), key=lambda kv: -kv[1])[: args.top]:
            share = f"{100 * secs / total:4.1f} %" if total else "  -  "
            print(f"    {secs:7.1f} s {share}  {path}")


if __name__ == "__main__":
    main()
