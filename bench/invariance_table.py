"""Run the whole invariance matrix and print its tables (markdown) for the README and docs/invariance.md.

Usage::

    python bench/invariance_table.py [--full] [--out FILE] [--json FILE] [--slice | --tp | --pp]
    .venv-torchtitan/bin/python bench/invariance_table.py --library torchtitan   # in the backend's venv

Each case is one fp32 optimizer step of the tiny Llama on the fixed 12-sample batch (lengths 3..60, one
sample with an all-zero loss mask), compared with its reference — the same loss and aggregation mode at
dp=1, sp=1, one micro-batch, no balancing, fsdp2 — and each reference with a plain single-process PyTorch
step. Compared: the model outputs of the initial parameters (log-probs and entropy, or values, of every
sample), the logged loss, the grad norm, every logged metric (reduced over micro-batches and ranks), the
updated parameters and the parameter update (per tensor, norm-wise). The summary gives, per
equivalence class (each value of each axis), the number of cases and the max relative difference of
each quantity; ``--full`` adds one row per case. The same code runs as tests:
``pytest -m invariance tests/invariance``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.engine.common import tiny_model  # noqa: E402
from tests.invariance.batch import make_invariance_batch  # noqa: E402
from tests.invariance.cases import (  # noqa: E402
    LIBRARY_BACKENDS,
    SLICE,
    XFAIL,
    Case,
    all_cases,
    library_backend_cases,
    pp_cases,
    references,
    tp_cases,
)
from tests.invariance.compare import CHECKED, COMPARED, RTOL, compare, failures  # noqa: E402
from tests.invariance.plain import plain_step  # noqa: E402
from tests.invariance.results import MatrixResults  # noqa: E402

Row = tuple[str, Case, dict[str, Any]]
AXES = (("loss", "loss"), ("agg", "loss_agg_mode"), ("dp", "dp"), ("sp", "sp (Ulysses)"), ("tp", "tp"),
        ("pp", "pp"), ("micro", "micro-batching"), ("balance", "SequenceBalancing"), ("strategy", "strategy"))
MICRO_NAMES = {"one": "one micro-batch", "fixed1": "fixed, 1 per micro-batch",
               "fixed2": "fixed, 2 per micro-batch", "dynamic": "dynamic, 64-token micro-batches"}


def _fmt(x: float) -> str:
    return "0" if x == 0 else f"{x:.1e}"


def _cells(diffs: list[dict[str, Any]]) -> str:
    return " | ".join(_fmt(max(d[k] for d in diffs)) for k in COMPARED)


def _header(first: str, second: str) -> list[str]:
    return [f"| {first} | {second} | " + " | ".join(COMPARED) + " | pass |",
            "|---|---|" + "---|" * (len(COMPARED) + 1)]


def summary_table(rows: list[Row]) -> list[str]:
    """One row per equivalence class: every case with that value of that axis."""
    lines = _header("equivalence class", "cases")
    refs = [d for name, _, d in rows if name.endswith("plain PyTorch")]
    cases = [(c, d) for name, c, d in rows if not name.endswith("plain PyTorch")]
    groups: list[tuple[str, list[dict[str, Any]]]] = [("reference (dp=1, sp=1, one micro-batch, fsdp2) = "
                                                       "plain PyTorch step", refs)]
    for attr, label in AXES:
        values = sorted({getattr(c, attr) for c, _ in cases}, key=str)
        for value in values:
            shown = MICRO_NAMES.get(value, value) if attr == "micro" else ("on" if value is True else
                                                                          "off" if value is False else value)
            groups.append((f"{label} = {shown}", [d for c, d in cases if getattr(c, attr) == value]))
    groups.append(("all cases", [d for _, d in cases]))
    for name, diffs in groups:
        ok = all(not failures(d, RTOL) for d in diffs)
        lines.append(f"| {name} | {len(diffs)} | {_cells(diffs)} | {'yes' if ok else '**NO**'} |")
    return lines


def full_table(rows: list[Row]) -> list[str]:
    """One row per case (and per reference)."""
    lines = _header("case (vs its reference)", "compared")
    for name, _, d in rows:
        what = (f"{len(d['detail']['outputs'])} outputs, loss, grad norm, {len(d['detail']['metrics'])} "
                f"metrics, {len(d['detail']['params'])} param tensors")
        ok = "yes" if not failures(d, RTOL) else "**NO**"
        lines.append(f"| `{name}` | {what} | {_cells([d])} | {ok} |")
    return lines


def run(cases: list[Case]) -> list[Row]:
    """Every reference against plain PyTorch, then every case against its reference."""
    with tempfile.TemporaryDirectory(prefix="invariance_") as tmp:
        model = tiny_model(str(Path(tmp) / "model"))
        batch = make_invariance_batch(model)
        matrix = MatrixResults(model, batch, cases)
        rows: list[Row] = []
        for ref in references(cases):
            diffs = compare(matrix.result(ref), plain_step(ref, model, batch), matrix.before(ref.model_type))
            rows.append((f"{ref.loss}/{ref.agg} reference vs plain PyTorch", ref, diffs))
        for case in cases:
            rows.append((f"{case.id} vs {case.reference().id.split('/', 2)[2]}", case, matrix.diffs(case)))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="also print one row per case")
    parser.add_argument("--out", help="also write the printed tables to this file")
    parser.add_argument("--json", help="write every row's differences (and per-metric detail) to this file")
    parser.add_argument("--slice", action="store_true", help="only the default-CI slice")
    parser.add_argument("--tp", action="store_true", help="only the tensor-parallel block")
    parser.add_argument("--pp", action="store_true", help="only the pipeline-parallel block")
    parser.add_argument("--library", choices=LIBRARY_BACKENDS, help="only this library backend's block")
    args = parser.parse_args()

    wanted = (list(SLICE) if args.slice else tp_cases() if args.tp else pp_cases() if args.pp
              else library_backend_cases(args.library) if args.library else all_cases())
    known = [c for c in wanted if c in XFAIL]  # known failures: not run, listed below the table
    cases = [c for c in wanted if MatrixResults.available(c) and c not in XFAIL]
    missing = sorted({c.strategy for c in wanted if c not in XFAIL} - {c.strategy for c in cases})
    if not cases:
        print(f"no case can run here: backend(s) {missing} not installed in this venv "
              f"(a library backend's venv: VENV=.venv-NAME EXTRAS=NAME bash scripts/setup_venv.sh)")
        return 1
    start = time.perf_counter()
    rows = run(cases)
    elapsed = time.perf_counter() - start

    n_bad = sum(bool(failures(d, RTOL)) for _, _, d in rows)
    lines = summary_table(rows)
    lines.append("")
    lines.append(f"{len(cases)} cases + {len(rows) - len(cases)} references, tolerance {RTOL:g} relative, "
                 f"{n_bad} failing, {elapsed:.0f} s" + (f"; not run (backend missing): {missing}" if missing
                                                        else ""))
    if known:
        lines.append("")
        lines += [f"Known failure (xfail, strict): `{c.id}`: {XFAIL[c]}" for c in known]
    if args.full:
        lines += ["", *full_table(rows)]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{"case": name, **{k: d[k] for k in CHECKED},
              "metrics_detail": d["detail"]["metrics"]} for name, _, d in rows], indent=1))
    return 1 if n_bad else 0


if __name__ == "__main__":
    sys.exit(main())
