"""Reference baselines in the style of verl 0.9.1, for the benchmarks and the equivalence tests.

Written for this project (not copied): the textbook heap Karmarkar-Karp that verl ships
(``verl/utils/seqlen_balancing.py``: a ``heapq`` of states, each state a list of ``k`` sets, every
merge re-sorting the sets with ``sorted()``), and verl's dynamic micro-batch count loop (start at
``ceil(total / budget)``, partition with Karmarkar-Karp ``equal_size=False``, add one micro-batch until
every partition fits the budget). They are deliberately straightforward: they are what we measure
against.
"""

from __future__ import annotations

import heapq
import math
from typing import Any


class _Set:
    """One partition of a state: a running sum and its (index, value) members."""

    def __init__(self) -> None:
        self.total: Any = 0
        self.items: list[tuple[int, Any]] = []

    def add(self, idx: int, value: Any) -> None:
        self.items.append((idx, value))
        self.total += value

    def absorb(self, other: _Set) -> None:
        for idx, value in other.items:
            self.add(idx, value)

    def __lt__(self, other: _Set) -> bool:
        if self.total != other.total:
            return self.total < other.total
        if len(self.items) != len(other.items):
            return len(self.items) < len(other.items)
        return self.items < other.items


class _State:
    """k sets, kept sorted heaviest first."""

    def __init__(self, items: list[tuple[int, Any]], k: int) -> None:
        self.k = k
        self.sets = [_Set() for _ in range(k)]
        for s, (idx, value) in zip(self.sets, items):
            s.add(idx, value)
        self.sets = sorted(self.sets, reverse=True)

    @property
    def spread(self) -> Any:
        return self.sets[0].total - self.sets[-1].total

    def merge(self, other: _State) -> None:
        for i in range(self.k):
            self.sets[i].absorb(other.sets[self.k - 1 - i])
        self.sets = sorted(self.sets, reverse=True)

    def __lt__(self, other: _State) -> bool:  # heapq is a min-heap: larger spread first
        if self.spread != other.spread:
            return self.spread > other.spread
        return self.sets[0] > other.sets[0]


def baseline_karmarkar_karp(seqlen_list: Any, k_partitions: int, equal_size: bool) -> list[list[int]]:
    """Textbook heap Karmarkar-Karp; returns ``k`` index lists, heaviest first (unsorted, as verl)."""
    ordered = sorted((value, i) for i, value in enumerate(seqlen_list))
    heap: list[_State] = []
    if equal_size:
        assert len(ordered) % k_partitions == 0
        for off in range(0, len(ordered), k_partitions):
            chunk = [(i, value) for value, i in ordered[off : off + k_partitions]]
            heapq.heappush(heap, _State(chunk, k_partitions))
    else:
        for value, i in ordered:
            heapq.heappush(heap, _State([(i, value)], k_partitions))
    while len(heap) > 1:
        first = heapq.heappop(heap)
        second = heapq.heappop(heap)
        first.merge(second)
        heapq.heappush(heap, first)
    return [[i for i, _ in s.items] for s in heap[0].sets]


def baseline_get_seqlen_balanced_partitions(
    seqlen_list: Any, k_partitions: int, equal_size: bool
) -> list[list[int]]:
    """verl's entry point: Karmarkar-Karp, then check every index appears once and sort each part."""
    assert len(seqlen_list) >= k_partitions
    parts = baseline_karmarkar_karp(seqlen_list, k_partitions, equal_size)
    assert len(parts) == k_partitions
    seen: set[int] = set()
    out = []
    for i, part in enumerate(parts):
        assert len(part) > 0, f"the {i}-th partition is empty"
        seen.update(part)
        out.append(sorted(part))
    assert seen == set(range(len(seqlen_list)))
    return out


def baseline_dynamic_micro_batches(seqlens: list[int], budget: int) -> list[list[int]]:
    """verl's dynamic micro-batch loop: KK at ceil(total/budget), then +1 until every part fits."""
    assert max(seqlens) <= budget
    num = min(len(seqlens), math.ceil(sum(seqlens) / budget))
    while True:
        parts = baseline_get_seqlen_balanced_partitions(seqlens, num, equal_size=False)
        if all(sum(seqlens[i] for i in p) <= budget for p in parts):
            return parts
        num += 1
