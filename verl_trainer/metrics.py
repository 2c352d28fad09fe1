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
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torchmetrics import Metric as _TMMetric
from torchmetrics.aggregation import MaxMetric, MeanMetric, MinMetric, SumMetric

from verl_trainer.utils.distributed import all_gather_object, is_initialized

__all__ = ["Metric", "MetricAccumulator", "Reduction", "reduce_metrics", "token_stats"]


class Reduction(str, Enum):
    """How a metric combines over micro-batches and ranks (see the module docstring)."""

    SUM = "sum"
    MEAN = "mean"
    MIN = "min"
    MAX = "max"


@dataclass(frozen=True, eq=False)
class Metric:
    """One metric value of one micro-batch, with its reduction.

    Attributes:
        value: A number or tensor (detached on construction). ``SUM``/``MEAN``: a scalar (one element).
            ``MIN``/``MAX``: any shape; every element counts, an empty tensor contributes nothing.
        reduction: A :class:`Reduction` (or its string value).
        weight: ``MEAN`` only: the weight of this value (e.g. the token count it averages); ``None``
            counts 1.

    """

    value: torch.Tensor | float
    reduction: Reduction = Reduction.MEAN
    weight: torch.Tensor | float | None = None

    def __post_init__(self) -> None:
        try:
            reduction = Reduction(self.reduction)
        except ValueError:
            raise ValueError(
                f"unknown metric reduction {self.reduction!r}; valid: "
                f"{', '.join(r.value for r in Reduction)}"
            ) from None
        object.__setattr__(self, "reduction", reduction)
        value = self.value.detach() if isinstance(self.value, torch.Tensor) else self.value
        object.__setattr__(self, "value", value)
        if reduction in (Reduction.SUM, Reduction.MEAN) and isinstance(value, torch.Tensor) \
                and value.numel() != 1:
            raise ValueError(
                f"a {reduction.value.upper()} metric needs a scalar value, got shape {tuple(value.shape)}; "
                "reduce it first (e.g. Metric.token_mean(values, mask))."
            )
        if self.weight is not None:
            if reduction is not Reduction.MEAN:
                raise ValueError(f"weight is only meaningful for MEAN metrics, not {reduction.value.upper()}")
            if isinstance(self.weight, torch.Tensor):
                object.__setattr__(self, "weight", self.weight.detach())

    @classmethod
    def sum(cls, value: torch.Tensor | float) -> Metric:
        """Declare a partial value (global denominators, ``x dp_size``): micro-batch sum, rank mean."""
        return cls(value, Reduction.SUM)

    @classmethod
    def mean(cls, value: torch.Tensor | float, weight: torch.Tensor | float | None = None) -> Metric:
        """Declare a weighted mean over micro-batches and ranks."""
        return cls(value, Reduction.MEAN, weight)

    @classmethod
    def min(cls, value: torch.Tensor | float) -> Metric:
        """Declare the minimum over every element, micro-batch and rank."""
        return cls(value, Reduction.MIN)

    @classmethod
    def max(cls, value: torch.Tensor | float) -> Metric:
        """Declare the maximum over every element, micro-batch and rank."""
        return cls(value, Reduction.MAX)

    @classmethod
    def token_mean(cls, values: torch.Tensor, mask: torch.Tensor) -> Metric:
        """Declare the token mean of ``values`` [b, t] over ``mask`` [b, t], weighted by the token count.

        Reduced, it is the token mean of the whole step (all micro-batches, all ranks). A micro-batch
        without tokens has value 0 and weight 0.
        """
        mask = mask.bool()
        count = mask.sum()
        zero = torch.zeros((), dtype=values.dtype, device=values.device)
        total = torch.where(mask, values.detach(), zero).sum()
        return cls(total / count.clamp_min(1).to(total.dtype), Reduction.MEAN, count)


_IDENTITY = {Reduction.SUM: 0.0, Reduction.MIN: math.inf, Reduction.MAX: -math.inf}


class _WeightedMeanMetric(MeanMetric):
    """``MeanMetric`` whose weights survive ``nan_strategy="disable"``.

    torchmetrics 1.9 replaces the weights by ones when NaN checking is disabled; this update keeps them
    (and lets a NaN through to the logged value). States, cross-rank sync (sum of ``mean_value`` and
    ``weight``) and ``compute`` are ``MeanMetric``'s.
    """

    def update(self, value: torch.Tensor | float, weight: torch.Tensor | float | None = None) -> None:
        """Add ``value`` with ``weight`` (default 1)."""
        value = torch.as_tensor(value, dtype=self.dtype, device=self.device)
        if weight is None:
            weight = torch.ones_like(value)
        weight = torch.as_tensor(weight, dtype=self.dtype, device=self.device)
        weight = torch.broadcast_to(weight, value.shape)
        self.mean_value += (value * weight).sum()
        self.weight += weight.sum()


def _new_state(reduction: Reduction, device: torch.device) -> _TMMetric:
    cls = {Reduction.SUM: SumMetric, Reduction.MEAN: _WeightedMeanMetric, Reduction.MIN: MinMetric,
           Reduction.MAX: MaxMetric}[reduction]
    # "disable": a NaN is logged as NaN (it signals a diverged step) and costs no check.
    state = cls(nan_strategy="disable", sync_on_compute=False).to(device)
    return state.set_dtype(torch.float64)


class MetricAccumulator:
    """Accumulates the metric dicts of one step's micro-batches; reduces them over ranks on compute.

    Use one accumulator per optimizer step (or per logging interval): ``update`` once per micro-batch,
    ``compute`` once on every rank of the group (it is collective), then ``reset``.

    Args:
        device: Where the states live; default CPU, or the current CUDA device when the process group's
            backend is NCCL (moved there on :meth:`compute`).

    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self._states: dict[str, _TMMetric] = {}
        self._reductions: dict[str, Reduction] = {}

    def __len__(self) -> int:
        return len(self._states)

    def _state(self, name: str, reduction: Reduction) -> _TMMetric:
        known = self._reductions.get(name)
        if known is None:
            self._reductions[name] = reduction
            self._states[name] = _new_state(reduction, self._device)
        elif known is not reduction:
            raise ValueError(
                f"metric {name!r} was declared {known.value.upper()} and now {reduction.value.upper()}; "
                "a metric must keep one reduction."
            )
        return self._states[name]

    def update(self, metrics: Mapping[str, Metric]) -> None:
        """Add one micro-batch's metrics.

        Raises:
            TypeError: A value is not a :class:`Metric` (every metric must declare its reduction).

        """
        for name, metric in metrics.items():
            if not isinstance(metric, Metric):
                raise TypeError(
                    f"metric {name!r} is a {type(metric).__name__}, not a verl_trainer.metrics.Metric; "
                    "declare its reduction, e.g. Metric.mean(value) or Metric.sum(partial_loss)."
                )
            state = self._state(name, metric.reduction)
            value = torch.as_tensor(metric.value, dtype=torch.float64).to(self._device)
            if metric.reduction is Reduction.MEAN:
                weight = 1.0 if metric.weight is None else metric.weight
                state.update(value, torch.as_tensor(weight, dtype=torch.float64).to(self._device))
            else:
                # An empty MIN/MAX value (no real token here) contributes the identity element.
                identity = torch.tensor(_IDENTITY[metric.reduction], dtype=torch.float64, device=self._device)
                state.update(value if value.numel() > 0 else identity)

    def reset(self) -> None:
        """Forget everything accumulated."""
        self._states.clear()
        self._reductions.clear()

    def _agree_on_names(self, group: Any) -> None:
        """Make every rank hold the same metric names (union), so the per-metric collectives match."""
        local = {name: r.value for name, r in self._reductions.items()}
        gathered = all_gather_object(local, group)
        union: dict[str, str] = {}
        for rank_names in gathered:
            for name, reduction in (rank_names or {}).items():
                if union.setdefault(name, reduction) != reduction:
                    raise ValueError(
                        f"metric {name!r} is {union[name].upper()} on one rank and {reduction.upper()} on "
                        "another; every rank must declare the same reduction."
                    )
        for name in union.keys() - local.keys():
            reduction = Reduction(union[name])
            state = self._state(name, reduction)
            # An identity update (weight 0 for MEAN): no effect on the result, no "compute before
            # update" warning.
            zero = torch.zeros((), dtype=torch.float64, device=self._device)
            if reduction is Reduction.MEAN:
                state.update(zero, zero)
            else:
                state.update(zero + _IDENTITY[reduction])

    def compute(self, process_group: Any = None, sync_dist: bool = True) -> dict[str, float]:
        """Reduce over the accumulated micro-batches and, if distributed, over the ranks of a group.

        Collective when it syncs: call it on every rank of ``process_group``.

        Args:
            process_group: The group to reduce over; ``None`` = the default (world) group. Pass the DP
                group or the world: both give the same values (see the module docstring).
            sync_dist: ``False`` reduces this rank's micro-batches only.

        Returns:
            ``{name: float}``, sorted by name. A ``MEAN`` whose total weight is 0 gives NaN; a
            ``MIN``/``MAX`` that saw no element on any rank gives +inf/-inf.

        """
        sync = sync_dist and is_initialized()
        num_ranks = 1
        if sync:
            self._agree_on_names(process_group)
            num_ranks = dist.get_world_size(process_group)
            if dist.get_backend(process_group) == "nccl":
                self._device = torch.device("cuda", torch.cuda.current_device())
                for state in self._states.values():
                    state.to(self._device)
        out: dict[str, float] = {}
        for name in sorted(self._states):
            state = self._states[name]
            with state.sync_context(process_group=process_group, should_sync=sync,
                                    distributed_available=lambda: sync):
                value = float(state.compute())
            if self._reductions[name] is Reduction.SUM:
                value /= num_ranks  # mean over ranks of each rank's micro-batch sum
            out[name] = value
        return out


def reduce_metrics(
    metrics: Iterable[Mapping[str, Metric]],
    process_group: Any = None,
    sync_dist: bool = True,
) -> dict[str, float]:
    """Reduce per-micro-batch metric dicts over micro-batches and ranks (collective when distributed).

    Args:
        metrics: One ``{name: Metric}`` per micro-batch of this rank (a name may be missing from some).
        process_group: See :meth:`MetricAccumulator.compute`.
        sync_dist: See :meth:`MetricAccumulator.compute`.

    Returns:
        ``{name: float}``: the values of the whole step, as if computed in one piece on one process.

    """
    acc = MetricAccumulator()
    for micro_batch_metrics in metrics:
        acc.update(micro_batch_metrics)
    return acc.compute(process_group=process_group, sync_dist=sync_dist)


def token_stats(values: torch.Tensor, mask: torch.Tensor, prefix: str) -> dict[str, Metric]:
    """``{prefix}/mean``, ``/min`` and ``/max`` of ``values`` ``[B, T]`` over ``mask`` ``[B, T]``.

    The mean is a token mean (:meth:`Metric.token_mean`); min and max see only masked-in tokens.
    """
    m = mask.bool()
    return {
        f"{prefix}/mean": Metric.token_mean(values, m),
        f"{prefix}/min": Metric.min(values[m]),
        f"{prefix}/max": Metric.max(values[m]),
    }
