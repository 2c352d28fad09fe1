"""Metric values that carry their reduction, and their reduction over micro-batches and ranks.

A loss function returns ``(loss, metrics)`` with ``metrics: dict[str, Metric]``; each :class:`Metric`
declares its :class:`Reduction` (``SUM``, ``MEAN``, ``MIN``, ``MAX``; what each means: docs/design.md §5).
Invariant: the reduced value does not depend on micro-batching, dp size, sp size or padding samples, and
is unchanged when ranks hold duplicate values, so the process group may be the world or the DP group.

Files: ``metric.py`` (the values, and verl's metric API under verl's names: ``AggregationType``,
``Metric(aggregation, value)`` with ``append`` / ``extend`` / ``aggregate`` / ``chain``), ``accumulator.py``
(:class:`MetricAccumulator`: micro-batches and ranks, through torchmetrics), ``reduce.py``
(:func:`reduce_metrics`). The names the recipes log: docs/metrics.md.
"""

from verl_trainer.metrics.accumulator import MetricAccumulator
from verl_trainer.metrics.metric import AggregationType, Metric, Reduction, sample_stats, token_stats
from verl_trainer.metrics.reduce import reduce_metrics

__all__ = ["AggregationType", "Metric", "MetricAccumulator", "Reduction", "reduce_metrics", "sample_stats",
           "token_stats"]
