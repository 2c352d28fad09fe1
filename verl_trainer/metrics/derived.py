"""Metrics computed from other metrics' reduced (global) values, after the reduction over ranks.

A value such as a load imbalance ``max_e c_e / mean_e c_e`` is not a reduction of per-micro-batch values:
it is a function of global totals. Each rule here reads the reduced ``{name: value}`` and returns new
names; :meth:`~verl_trainer.metrics.MetricAccumulator.compute` applies them last, so they are as invariant
as the totals they read.

Rules:

* ``moe/layer{l}/expert{e}/tokens`` (``SUM``: tokens routed to expert ``e`` in MoE layer ``l``) →
  ``moe/layer{l}/load_imbalance = max_e / mean_e`` (1 = balanced, ``E / k`` = every token on the same
  ``k`` experts) and ``moe/load_imbalance``, the largest over layers.
"""

from __future__ import annotations

import re
from collections import defaultdict

DERIVED_FROM = ("moe/",)
"""Name prefixes the rules read: a reduced set with no name under them has nothing to derive."""
_EXPERT_TOKENS = re.compile(r"^moe/layer(\d+)/expert(\d+)/tokens$")


def expert_tokens_name(layer: int, expert: int) -> str:
    """The ``SUM`` metric name of the tokens routed to ``expert`` in MoE layer ``layer``."""
    return f"moe/layer{layer}/expert{expert}/tokens"


def derived_metrics(reduced: dict[str, float]) -> dict[str, float]:
    """The derived values of ``reduced`` (see the module docstring); ``{}`` when no rule applies."""
    layers: dict[int, list[float]] = defaultdict(list)
    for name, value in reduced.items():
        match = _EXPERT_TOKENS.match(name)
        if match:
            layers[int(match.group(1))].append(value)
    out: dict[str, float] = {}
    for layer, counts in sorted(layers.items()):
        mean = sum(counts) / len(counts)
        out[f"moe/layer{layer}/load_imbalance"] = max(counts) / mean if mean > 0 else float("nan")
    if out:
        out["moe/load_imbalance"] = max(out.values())
    return out
