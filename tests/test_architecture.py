"""Structural rules of the code base: no run-time import cycle; one implementation of an optimizer step.

The import graph is read from the source (``ast``): every ``import`` / ``from ... import`` of a project
module, at module level or inside a function (both run), except those under ``if TYPE_CHECKING:``.
A package importing its own submodules is not an edge back (importing a submodule imports its package
first by Python's rules, not by the project's choice).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "callbacks":  # installed as verl_trainer.callbacks
        parts = ["verl_trainer", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    files = [*(ROOT / "verl_trainer").rglob("*.py"), *(ROOT / "callbacks").rglob("*.py")]
    return {_module_name(p): p for p in files}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path) -> set[str]:
    """Project modules that ``name`` imports at run time."""
    found: set[str] = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def import_graph() -> dict[str, set[str]]:
    """``{module: project modules it imports at run time}``, without edges to its own packages."""
    sources = _sources()
    graph = {}
    for name, path in sources.items():
        parents = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        graph[name] = {m for m in _imports(name, path) if m in sources and m != name and m not in parents}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_run_time_import_cycle():
    graph = import_graph()
    assert "verl_trainer.trainer" in graph and "verl_trainer.training.loops" in graph["verl_trainer.trainer"]
    assert cycles(graph) == []


def test_one_implementation_of_an_optimizer_step():
    """Only ``BaseEngine.train_batch`` sequences zero-grad → micro-batches → step; nothing repeats it."""
    callers = []
    for path in [*(ROOT / "verl_trainer").rglob("*.py"), *(ROOT / "callbacks").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                calls = {c.func.attr for c in ast.walk(node) if isinstance(c, ast.Call)
                         and isinstance(c.func, ast.Attribute)}
                if {"optimizer_zero_grad", "optimizer_step"} <= calls:
                    callers.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert callers == ["verl_trainer/engine/base.py:train_batch"]


@pytest.mark.slow
@pytest.mark.parametrize(("flags", "max_files", "max_hops"), [((), 14, 30), (("--no-balancing",), 12, 30)])
def test_the_grpo_step_path_stays_short(flags, max_files, max_hops):
    """Issue 17's bound on the orchestration of one GRPO step (``scripts/step_path.py``'s measured view)."""
    script = str(ROOT / "scripts" / "step_path.py")
    out = subprocess.run([sys.executable, script, *flags], capture_output=True, text=True, check=True,
                         env={**os.environ, "WANDB_MODE": "offline"}).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("step path, leaf helpers stepped over:"))
    files, hops = (int(n) for n in re.findall(r"(\d+) (?:files|hops)", line))
    assert files <= max_files and hops <= max_hops, line
