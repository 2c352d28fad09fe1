"""Metric values that carry their reduction, and their reduction over micro-batches and ranks.

A loss function returns ``(loss, metrics)`` with ``metrics: dict[str, Metric]``. Each :class:`Metric`
declares how it combines with the same metric from the other micro-batches of the step and from the
other ranks, so that **the logged value does not depend on micro-batching, dp size, sp size or padding
samples**: it equals the value of the whole step computed in one piece on one process.

Reductions (``G`` = the ranks of the process group, ``m`` = the micro-batches of one rank):

* ``SUM`` — a *partial* value already normalised by the step's global denominators and multiplied by
  ``dp_size`` (what :func:`verl_trainer.core_algos.agg_loss` returns): summed over a rank's
  micro-batches, then **averaged over ranks**: ``value = mean_G(sum_m v)``. The ``x dp_size`` factor in
  each partial value makes the average over ranks the global value. (verl: "mean over DP, then sum over
  micro-batches".) To log a global total such as a token count with ``SUM``, log the local count times
  ``dp_size`` — exactly like the loss.
* ``MEAN`` — a weighted mean: ``value = sum(v * w) / sum(w)`` over every micro-batch of every rank.
  A ratio (clip fraction, approx KL, entropy) is logged as its micro-batch token mean with
  ``weight`` = the micro-batch's token count (:meth:`Metric.token_mean`); the reduced value is then the
  token mean of the whole step, and a padding micro-batch (weight 0) changes nothing. Without a weight
  every update counts 1, which is invariant only for values equal on every micro-batch (a coefficient).
* ``MIN`` / ``MAX`` — over every element of every micro-batch of every rank. Compute them over real
  tokens/samples only: a padding sample must not contribute its zeros.

All four are unchanged when ranks hold duplicate values (the sp ranks of one Ulysses group compute the
same loss), so the process group may be the whole world or the DP group.

The cross-rank part is torchmetrics': ``SumMetric``, ``MeanMetric`` (weighted), ``MinMetric`` and
``MaxMetric`` synced over the process group (an all-gather of their states), with float64 states so the
result matches a one-shot computation to float32 round-off. The only bookkeeping here is agreeing on
the set of metric names first, so a rank that lacks a name (it produced no value) cannot make the
collectives of the others hang.

verl's metric API lives here under verl's names: ``AggregationType`` (= :class:`Reduction`), verl's
``Metric(aggregation, value=None)`` with ``append`` / ``extend`` / ``aggregate`` / ``chain`` /
``from_dict`` / ``init_list`` (the same :class:`Metric` class), and ``reduce_metrics({name: Metric |
list})`` (verl's local, in-place form of :func:`reduce_metrics`). Files: ``metric.py`` (the values),
``accumulator.py`` (micro-batches and ranks), ``reduce.py``.
"""

from verl_trainer.metrics.accumulator import MetricAccumulator
from verl_trainer.metrics.metric import AggregationType, Metric, Reduction, sample_stats, token_stats
from verl_trainer.metrics.reduce import reduce_metrics

__all__ = ["AggregationType", "Metric", "MetricAccumulator", "Reduction", "reduce_metrics", "sample_stats",
           "token_stats"]
