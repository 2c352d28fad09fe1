"""``reduce_metrics``: ours (micro-batch dicts, over micro-batches and ranks) and verl's (a dict of lists)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

import numpy as np
import torch

from verl_trainer.metrics.accumulator import MetricAccumulator
from verl_trainer.metrics.metric import Metric

__all__ = ["reduce_metrics"]


def _by_key_name(key: str, values: Any) -> float:
    """The rule of verl for a plain list: ``max`` in the key → max, else ``min`` → min, else the mean."""
    if isinstance(values, torch.Tensor):
        array = values.detach().to(torch.float64).cpu().numpy().reshape(-1)
    else:
        items = values if isinstance(values, (list, tuple)) else [values]
        array = np.asarray([float(v) for v in items], dtype=np.float64)
    if "max" in key or "min" in key:
        if array.size == 0:
            raise ValueError(
                f"metric {key!r} has no values, so it has no {'max' if 'max' in key else 'min'}; "
                "append at least one value, or log it as a Metric(aggregation=..., ...)."
            )
        return float(array.max() if "max" in key else array.min())
    return float(array.mean()) if array.size else math.nan


def reduce_metrics(
    metrics: Iterable[Mapping[str, Metric]] | MutableMapping[str, Metric | list[Any]],
    process_group: torch.distributed.ProcessGroup | None = None,
    sync_dist: bool = True,
) -> dict[str, float] | MutableMapping[str, Any]:
    """Reduce metrics: ours over micro-batches and ranks, or verl's dict of lists in place.

    Ours: ``metrics`` is an iterable of ``{name: Metric}`` dicts, one per micro-batch of this rank (a name
    may be missing from some); the result is the values of the whole step, as if computed in one piece on
    one process (collective when distributed: call it on every rank of ``process_group``).

    verl's (``verl.utils.metric.reduce_metrics``): ``metrics`` is one mapping ``{name: Metric | list}``,
    told apart from ours by being a mapping. Each entry is replaced, in place, by a float: a Metric by its
    :meth:`Metric.aggregate`, a list by its max if ``"max"`` is in the name, else its min if ``"min"`` is,
    else its mean (NaN for an empty list). Local only: no collective.

    Args:
        metrics: See above.
        process_group: Ours: the group to reduce over (see :meth:`MetricAccumulator.compute`).
        sync_dist: Ours: ``False`` reduces this rank's micro-batches only.

    Returns:
        Ours: ``{name: float}`` sorted by name. verl's: ``metrics`` itself, reduced.

    Raises:
        ValueError: verl's form with a ``process_group`` (it is local), or an empty list under a
            ``max``/``min`` name.

    """
    if isinstance(metrics, Mapping):
        if process_group is not None:
            raise ValueError(
                "reduce_metrics({name: values}) is verl's local form and takes no process_group; pass a list "
                "of per-micro-batch {name: Metric} dicts to reduce over ranks."
            )
        for key, values in metrics.items():
            metrics[key] = values.aggregate() if isinstance(values, Metric) else _by_key_name(key, values)
        return metrics
    acc = MetricAccumulator()
    for micro_batch_metrics in metrics:
        acc.update(micro_batch_metrics)
    return acc.compute(process_group=process_group, sync_dist=sync_dist)
