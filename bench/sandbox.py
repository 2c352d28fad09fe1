"""Per-call cost of the sandbox under each isolation tool, against a plain interpreter start in the same run.

Usage::

    python bench/sandbox.py [--rounds 15]

Sides, timed in paired rounds (each round runs every side once, the order rotated per round, so a round's
timings share the machine's load):

* ``python``: ``subprocess.run([python, "-I", "-B", "-c", "print(1)"])`` — the interpreter start every
  sandbox pays (the baseline).
* ``unshare -rn``: the same under ``unshare -rn`` with the old sandbox's resource limits — what
  ``run_python`` ran before it used an isolation tool (for the before/after).
* ``none``, ``bwrap``, ``nsjail``, ``nsjail+cgroup``: ``run_python("print(1)")`` under each installed tool
  (``none``: the unconfined opt-in).
* ``code reward/<tool>``: ``default_compute_score`` on a code sample with 3 stdin tests (3 sandboxed runs)
  under the auto-chosen tool.

Prints per side the median ms per call and its median ratio to the baseline of the same round.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from verl_trainer.rewards import default_compute_score
from verl_trainer.rewards.jail import Isolation, candidates, interpreter
from verl_trainer.rewards.sandbox import resolve_isolation, run_python

CODE = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
CASES = json.dumps({"inputs": ["1 2\n", "3 4\n", "5 5\n"], "outputs": ["3\n", "7\n", "10\n"]})


def _old_limits() -> None:
    os.setsid()
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))


def sides() -> dict[str, Callable[[], object]]:
    py = [interpreter(), "-I", "-B", "-c", "print(1)"]
    out: dict[str, Callable[[], object]] = {
        "python": lambda: subprocess.run(py, capture_output=True, check=True),
    }
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-rn", "true"], capture_output=True).returncode == 0:
        out["unshare -rn"] = lambda: subprocess.run([unshare, "-rn", *py], capture_output=True, check=True,
                                                    preexec_fn=_old_limits)
    isolations = [Isolation("none"), *candidates("auto")[0]]
    for iso in isolations:
        out[iso.label] = lambda iso=iso: run_python("print(1)", isolation=iso)
    auto = resolve_isolation()
    out[f"code reward/{auto.label}"] = lambda: default_compute_score("code", CODE, CASES)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    table = sides()
    names = list(table)
    for fn in table.values():  # warm-up: imports, the probe
        fn()
    times: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        this: dict[str, float] = {}
        for name in order:
            start = time.perf_counter()
            table[name]()
            this[name] = time.perf_counter() - start
        for name in names:
            times[name].append(this[name])
            ratios[name].append(this[name] / this["python"])
    print(f"sandbox per-call cost, {args.rounds} rotated rounds, {sys.platform}, load "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'side':<28}{'ms / call':>10}{'x python':>10}")
    for name in names:
        ms, ratio = 1e3 * statistics.median(times[name]), statistics.median(ratios[name])
        print(f"{name:<28}{ms:>10.1f}{ratio:>10.2f}")


if __name__ == "__main__":
    main()
