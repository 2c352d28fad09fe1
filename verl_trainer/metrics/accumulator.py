"""MetricAccumulator: reduces the metrics of one step over micro-batches and, through torchmetrics, ranks.

The semantics of the reductions are in the package docstring (:mod:`verl_trainer.metrics`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torchmetrics import Metric as _TMMetric
from torchmetrics.aggregation import MaxMetric, MeanMetric, MinMetric, SumMetric

from verl_trainer.metrics.derived import DERIVED_FROM, derived_metrics
from verl_trainer.metrics.metric import Metric, Reduction
from verl_trainer.utils.distributed import all_gather_object, is_initialized

__all__ = ["MetricAccumulator"]


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


def _identity_update(state: _TMMetric, reduction: Reduction, device: torch.device) -> None:
    """An update that changes no result (weight 0 for MEAN) and avoids the "compute before update" warning."""
    zero = torch.zeros((), dtype=torch.float64, device=device)
    if reduction is Reduction.MEAN:
        state.update(zero, zero)
    else:
        state.update(zero + _IDENTITY[reduction])


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

        A Metric holding several values (verl's ``append``/``extend``) counts as that many micro-batch
        values of its name; an empty one only declares the name and its reduction.

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
            if not metric.values:
                _identity_update(state, metric.reduction, self._device)
            for value, weight in zip(metric.values, metric.weights):
                value = torch.as_tensor(value, dtype=torch.float64).to(self._device)
                if metric.reduction is Reduction.MEAN:
                    weight = 1.0 if weight is None else weight
                    state.update(value, torch.as_tensor(weight, dtype=torch.float64).to(self._device))
                elif value.numel() > 0:
                    state.update(value)
                else:  # an empty MIN/MAX value (no real token here) contributes nothing
                    _identity_update(state, metric.reduction, self._device)

    def reset(self) -> None:
        """Forget everything accumulated."""
        self._states.clear()
        self._reductions.clear()

    def _agree_on_names(self, group: dist.ProcessGroup | None) -> None:
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
            _identity_update(self._state(name, reduction), reduction, self._device)

    def compute(self, process_group: dist.ProcessGroup | None = None,
                sync_dist: bool = True) -> dict[str, float]:
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
        if any(name.startswith(DERIVED_FROM) for name in out):  # values read from the global totals
            out.update(derived_metrics(out))
        return dict(sorted(out.items()))
