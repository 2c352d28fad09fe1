"""A metric's values with their reduction: :class:`Metric`, :class:`Reduction` (verl's ``AggregationType``).

One class serves two ways of writing metrics:

* ours: one value per micro-batch, declared with its reduction (``Metric.sum(partial_loss)``,
  ``Metric.mean(x, weight=n)``, ``Metric.token_mean(values, mask)``, ``Metric(value, "max")``), handed to
  :class:`~verl_trainer.metrics.MetricAccumulator`, which reduces over micro-batches and ranks;
* verl's (``verl.utils.metric.Metric``): ``Metric(aggregation, value=None)`` collects values with
  ``append`` / ``extend`` / ``chain`` and reduces them locally with :meth:`Metric.aggregate`.

A Metric holding several values is, to the accumulator, the same as several micro-batch Metrics of that
name holding one value each, so a verl-style Metric logged from a loss keeps the invariance rules of the
package docstring.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from enum import Enum
from numbers import Real
from typing import Any

import torch

__all__ = ["AggregationType", "Metric", "Reduction", "sample_stats", "token_stats"]


class Reduction(str, Enum):
    """How a metric combines over micro-batches and ranks (see the package docstring)."""

    SUM = "sum"
    MEAN = "mean"
    MIN = "min"
    MAX = "max"


AggregationType = Reduction
"""verl's name for :class:`Reduction` (same values: ``"mean"``, ``"sum"``, ``"min"``, ``"max"``)."""

_UNSET: Any = object()


def _reduction(value: Any) -> Reduction:
    try:
        return Reduction(value.value if isinstance(value, Enum) else value)
    except ValueError:
        raise ValueError(
            f"unknown metric reduction {value!r}; valid: {', '.join(r.value for r in Reduction)}"
        ) from None


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


class Metric:
    """Values of one metric with their reduction; ours and verl's constructor both work.

    Ours: ``Metric(value, reduction="mean", weight=None)`` (or the constructors :meth:`sum`,
    :meth:`mean`, :meth:`min`, :meth:`max`, :meth:`token_mean`): one value of one micro-batch.
    ``SUM``/``MEAN`` values are scalars (a number or a one-element tensor, kept as a detached tensor so
    logging never synchronises a device); ``MIN``/``MAX`` values may be tensors of any shape (every element
    counts, an empty tensor contributes nothing); ``weight`` (``MEAN`` only) weighs the value, ``None``
    counts 1.

    verl's: ``Metric(aggregation, value=None)`` — ``aggregation`` given by keyword, or a string / enum as
    the first positional argument; ``value`` is a number, a scalar tensor (stored as a Python number, as
    verl does), a list of them or a Metric. Values are then added with :meth:`append` / :meth:`extend`.

    Args:
        first: Ours: the value. verl's: the aggregation, when it is a string or an enum.
        reduction: Ours: a :class:`Reduction` or its string value (default ``MEAN``). verl's form with a
            positional aggregation: the value (``Metric("mean", 1.0)``).
        weight: Ours, ``MEAN`` only: the weight of ``value``.
        value: The value, by keyword (both forms).
        aggregation: verl's name for the reduction, by keyword.

    Raises:
        ValueError: An unknown reduction, a non-scalar ``SUM``/``MEAN`` value, a weight on a metric that
            is not ``MEAN``.
        TypeError: Neither a value nor an aggregation, or both forms mixed.

    Attributes:
        reduction: How the values combine (:attr:`aggregation` in verl's words).
        values: The values, in the order they were added (a plain list, as verl's).

    """

    __slots__ = ("reduction", "values", "_weights")

    def __init__(self, first: Any = _UNSET, /, reduction: Any = _UNSET,
                 weight: torch.Tensor | float | None = None, *, value: Any = _UNSET,
                 aggregation: Reduction | str | None = None) -> None:
        self.values: list[torch.Tensor | float] = []
        self._weights: list[torch.Tensor | float | None] = []
        if aggregation is not None or isinstance(first, (str, Enum)):
            self._init_verl(first, reduction, weight, value, aggregation)
            return
        if first is not _UNSET and value is not _UNSET:
            raise TypeError("Metric got the value twice (positionally and as value=); pass it once.")
        value = first if value is _UNSET else value
        if value is _UNSET:
            raise TypeError(
                "Metric needs a value (ours: Metric(value, reduction='mean')) or an aggregation "
                "(verl's: Metric(aggregation='mean', value=None))."
            )
        self.reduction = _reduction(Reduction.MEAN if reduction is _UNSET else reduction)
        self._add(value, weight)

    def _init_verl(self, first: Any, second: Any, weight: torch.Tensor | float | None, value: Any,
                   aggregation: Reduction | str | None) -> None:
        """The form of verl: ``Metric(aggregation, value=None)``."""
        if aggregation is None:
            aggregation, first = first, _UNSET
        if weight is not None:
            raise TypeError(
                "verl's Metric(aggregation, value) takes no weight; use Metric.mean(value, weight=w)."
            )
        given = [v for v in (first, second, value) if v is not _UNSET]
        if len(given) > 1:
            raise TypeError(f"Metric(aggregation={aggregation!r}, ...) got {len(given)} values; pass one.")
        self.reduction = _reduction(aggregation)
        if given and given[0] is not None:
            initial = given[0]
            if isinstance(initial, (list, tuple, Metric)):
                self.extend(initial)
            else:
                self.append(initial)

    def _add(self, value: torch.Tensor | float, weight: torch.Tensor | float | None) -> None:
        """Add one value of ours (checked against the reduction) with its weight."""
        value = _detached(value)
        if self.reduction in (Reduction.SUM, Reduction.MEAN) and isinstance(value, torch.Tensor) \
                and value.numel() != 1:
            raise ValueError(
                f"a {self.reduction.value.upper()} metric needs a scalar value, got shape "
                f"{tuple(value.shape)}; reduce it first (e.g. Metric.token_mean(values, mask))."
            )
        if weight is not None and self.reduction is not Reduction.MEAN:
            raise ValueError(
                f"weight is only meaningful for MEAN metrics, not {self.reduction.value.upper()}"
            )
        self.values.append(value)
        self._weights.append(_detached(weight))

    # ------------------------------------------------------------------ ours: one value per micro-batch

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

    @property
    def value(self) -> torch.Tensor | float:
        """The one value of a single-valued metric (ours); see :attr:`values` for several."""
        return self._only(self.values, "value")

    @property
    def weight(self) -> torch.Tensor | float | None:
        """The weight of a single-valued ``MEAN`` metric (``None`` = 1)."""
        return self._only(self.weights, "weight")

    @property
    def weights(self) -> list[torch.Tensor | float | None]:
        """One weight per value (``None`` = 1), aligned with :attr:`values`."""
        missing = len(self.values) - len(self._weights)
        return self._weights[: len(self.values)] + [None] * max(missing, 0)

    def _only(self, items: list[Any], what: str) -> Any:
        if len(items) != 1:
            raise ValueError(
                f"this {self.reduction.value.upper()} metric holds {len(items)} values, so it has no single "
                f"{what}; read .values (and .weights) or reduce it with .aggregate()."
            )
        return items[0]

    def scale(self, factor: float) -> Metric:
        """A new metric of the same reduction and weights whose values are multiplied by ``factor``."""
        out = self.init_list()
        for value, weight in zip(self.values, self.weights):
            out._add(value * factor, weight)
        return out

    # ------------------------------------------------------------------ verl's API

    @property
    def aggregation(self) -> Reduction:
        """The name verl uses for :attr:`reduction`."""
        return self.reduction

    def append(self, value: torch.Tensor | float | Metric) -> None:
        """Add one value, by verl's rules.

        A number, a one-element tensor (stored as its Python number) or a Metric (its values are added,
        see :meth:`extend`).

        Raises:
            ValueError: A tensor with more than one element, or a value that is not a number.

        """
        if isinstance(value, Metric):
            self.extend(value)
            return
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"Metric.append takes a number or a one-element tensor, got shape {tuple(value.shape)}; "
                    "reduce it first, or use ours: Metric.min(tensor) / Metric.max(tensor)."
                )
            value = value.detach().item()
        if isinstance(value, bool) or not isinstance(value, Real):
            raise ValueError(f"Metric.append takes a number or a scalar tensor, got {type(value).__name__}")
        self.values.append(value)
        self._weights.append(None)

    def extend(self, values: Metric | Iterable[torch.Tensor | float]) -> None:
        """Add several values: a Metric's values (and weights) or an iterable of numbers.

        Raises:
            ValueError: A Metric with another aggregation.

        """
        if isinstance(values, Metric):
            if values.reduction is not self.reduction:
                raise ValueError(
                    f"cannot extend a {self.reduction.value.upper()} metric with a "
                    f"{values.reduction.value.upper()} one; the aggregation must match."
                )
            for value, weight in zip(values.values, values.weights):
                self.values.append(value)
                self._weights.append(weight)
            return
        for value in values:
            self.append(value)

    def aggregate(self) -> float:
        """Reduce the values held here (this process only): sum, mean, min or max.

        ``MEAN`` is the weighted mean ``sum(v * w) / sum(w)`` (weight ``None`` = 1, so verl's plain mean
        without weights); ``MIN``/``MAX`` look at every element of tensor values. With no value: ``MEAN``
        NaN, ``SUM`` 0, ``MIN`` +inf, ``MAX`` -inf (verl raises for an empty MIN/MAX). The same numbers as
        :class:`~verl_trainer.metrics.MetricAccumulator` gives for this metric on one process.
        """
        values = [torch.as_tensor(v, dtype=torch.float64).detach().cpu().reshape(-1) for v in self.values]
        flat = torch.cat(values) if values else torch.zeros(0, dtype=torch.float64)
        if self.reduction is Reduction.SUM:
            return float(flat.sum())
        if self.reduction is Reduction.MIN:
            return float(flat.min()) if flat.numel() else math.inf
        if self.reduction is Reduction.MAX:
            return float(flat.max()) if flat.numel() else -math.inf
        weights = torch.tensor([1.0 if w is None else float(w) for w in self.weights], dtype=torch.float64)
        total = weights.sum()
        return float((flat * weights).sum() / total) if total != 0 else math.nan

    @classmethod
    def chain(cls, metric_lists: Iterable[Metric]) -> Metric:
        """One Metric holding the values of all of ``metric_lists`` (same aggregation; empty: ``MEAN``)."""
        metrics = list(metric_lists)
        chained = cls(aggregation=metrics[0].reduction if metrics else Reduction.MEAN)
        for metric in metrics:
            chained.extend(metric)
        return chained

    @classmethod
    def aggregate_dp(cls, metric_lists: list[Metric]) -> float:
        """Reduce one Metric per DP rank, each holding that rank's micro-batch values (verl's rule).

        ``SUM``: the mean over ranks of each rank's sum (what :class:`MetricAccumulator` does over
        ranks); ``MEAN``: the (weighted) mean of every value; ``MIN``/``MAX``: over every value.

        Raises:
            ValueError: No metrics, or ranks holding different numbers of values (verl requires equal
                counts).

        """
        if not metric_lists:
            raise ValueError("Metric.aggregate_dp needs one Metric per DP rank, got none.")
        counts = [len(m.values) for m in metric_lists]
        if len(set(counts)) != 1:
            raise ValueError(
                f"Metric.aggregate_dp needs the same number of values on every rank, got {counts}; "
                "log one value per micro-batch on every rank."
            )
        value = cls.chain(metric_lists).aggregate()
        return value / len(metric_lists) if metric_lists[0].reduction is Reduction.SUM else value

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], aggregation: str | Reduction) -> dict[str, Metric]:
        """``{name: Metric(aggregation, value)}`` for every item of ``data``."""
        return {key: cls(aggregation=aggregation, value=value) for key, value in data.items()}

    def init_list(self) -> Metric:
        """An empty Metric with this one's aggregation."""
        return Metric(aggregation=self.reduction)

    def __repr__(self) -> str:
        return f"Metric(reduction={self.reduction.value!r}, values={self.values!r})"


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


def sample_stats(values: torch.Tensor, prefix: str) -> dict[str, Metric]:
    """``{prefix}/mean`` (weighted by the sample count), ``/min`` and ``/max`` of per-sample ``values``.

    Args:
        values: ``[n]`` one value per (real) sample.
        prefix: Metric-name prefix.
    """
    count = values.numel()
    mean = values.mean() if count else torch.zeros(())
    return {
        f"{prefix}/mean": Metric.mean(mean, weight=count),
        f"{prefix}/min": Metric.min(values),
        f"{prefix}/max": Metric.max(values),
    }
