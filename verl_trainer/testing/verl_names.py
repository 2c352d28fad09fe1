"""Run code written against verl's modules on ours: ``verl.*`` module names aliased to this package.

``with verl_module_aliases(): import verl.trainer.ppo.core_algos`` gives ``verl_trainer.core_algos``.
Only the modules whose public names this project keeps with verl's semantics are aliased
(:data:`VERL_MODULES`); parents (``verl``, ``verl.trainer``, ...) are empty stand-in modules. A real
``verl`` already imported is never shadowed: the aliases are refused then.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

VERL_MODULES: dict[str, str] = {
    "verl.trainer.ppo.core_algos": "verl_trainer.core_algos",
    "verl.utils.metric": "verl_trainer.metrics",
    "verl.utils.metric.utils": "verl_trainer.metrics",
}
"""verl's module name → ours."""


def verl_module_table(modules: Mapping[str, str] = VERL_MODULES) -> dict[str, types.ModuleType]:
    """The ``sys.modules`` entries that make ``modules`` importable under verl's names.

    Args:
        modules: verl's dotted module name → our module name.

    Returns:
        ``{name: module}`` for every aliased name and every parent package of one (the parents are
        empty modules whose attributes point at their children, so ``import verl.a.b; verl.a.b`` works).

    """
    table = {name: importlib.import_module(ours) for name, ours in modules.items()}
    for name in sorted(modules, key=lambda n: n.count("."), reverse=True):
        parts = name.split(".")
        for depth in range(len(parts) - 1, 0, -1):
            parent = ".".join(parts[:depth])
            if parent not in table:
                table[parent] = types.ModuleType(parent)
                table[parent].__path__ = []  # a package, so submodule imports look in sys.modules
    for name, module in table.items():
        parent, _, child = name.rpartition(".")
        if parent and isinstance(table[parent], types.ModuleType) and parent not in modules:
            setattr(table[parent], child, module)
    return table


@contextmanager
def verl_module_aliases(modules: Mapping[str, str] = VERL_MODULES) -> Iterator[dict[str, types.ModuleType]]:
    """Install :func:`verl_module_table` in ``sys.modules`` for the ``with`` block, then restore it.

    Raises:
        RuntimeError: A real ``verl`` is already imported (aliasing would shadow it).

    """
    if "verl" in sys.modules and getattr(sys.modules["verl"], "__file__", None):
        raise RuntimeError(
            f"a real verl is imported ({sys.modules['verl'].__file__}); run the aliased code in a process "
            "without it."
        )
    table = verl_module_table(modules)
    saved = {name: sys.modules.get(name) for name in table}
    sys.modules.update(table)
    try:
        yield table
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
