"""Fast Karmarkar-Karp (largest differencing) k-way partitioning on numpy arrays.

The engine behind :func:`verl_trainer.core_algos.balancing.karmarkar_karp`: :func:`kk_partition` returns
the same partition as the textbook heap algorithm verl ships (a heap of states of ``k`` sets; pop the two
states with the largest spread, merge the heaviest set of one with the lightest of the other, push back),
tie-breaking included.

Invariants: values are non-negative integers (callers convert); when the encoded sums would not fit 62
bits they are quantised by a right shift, which keeps the balancing but not bit-exactness.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Callable
from itertools import accumulate

import numpy as np

__all__ = ["kk_partition", "stable_argsort"]

_SMALL_SORT = 4096
_TAIL_SETS = 128
_ROUND_COST = 7.0


def stable_argsort(values: np.ndarray) -> np.ndarray:
    """Stable ascending argsort of a non-negative ``int64`` array ``[n]``.

    Large arrays use an LSD radix sort on 16-bit digits (numpy's stable sort of ``uint16`` is a radix
    sort), several times faster than a comparison sort for the value ranges seen here.
    """
    n = values.shape[0]
    if n <= _SMALL_SORT:
        return np.argsort(values, kind="stable")
    lo = int(values.min())
    span = int(values.max()) - lo
    passes = max(1, -(-span.bit_length() // 16))
    if passes > 3:
        return np.argsort(values, kind="stable")
    x = values - lo if lo else values
    order = np.argsort((x & 0xFFFF).astype(np.uint16), kind="stable")
    for p in range(1, passes):
        digit = ((x[order] >> (16 * p)) & 0xFFFF).astype(np.uint16)
        order = order[np.argsort(digit, kind="stable")]
    return order


class _Merges:
    """Merge records: set ``children[i]`` (gids) was absorbed into ``parents[i]``.

    ``depth`` counts batches recorded one after another; no chain gid -> parent -> ... is longer.
    """

    def __init__(self) -> None:
        self.children: list[np.ndarray] = []
        self.parents: list[np.ndarray] = []
        self.depth = 0

    def add(self, children: np.ndarray, parents: np.ndarray, steps: int = 1) -> None:
        self.children.append(children)
        self.parents.append(parents)
        self.depth += steps

    def roots(self, n: int, mask: int) -> np.ndarray:
        """The root gid of every gid ``[n + 1]``."""
        root = np.arange(n + 1)
        if not self.children:
            return root
        root[np.concatenate(self.children, axis=None) & mask] = np.concatenate(self.parents, axis=None) & mask
        for _ in range(self.depth.bit_length()):  # pointer jumping halves every chain
            root = root[root]
        return root


@functools.lru_cache(maxsize=64)
def _merge_fn(k: int) -> Callable[[list[int], list[int], int], list[int]]:
    """``merge(a, b, hi)``: set ``i`` of ``a`` plus the sum/count of set ``k-1-i`` of ``b``, sorted.

    Generated for each ``k`` (as ``collections.namedtuple`` does): an unrolled expression is about
    twice as fast as a comprehension over ``zip``, and these merges are the Python hot loop.
    """
    if k > 64:
        return lambda a, b, hi: sorted([x + (y & hi) for x, y in zip(a, reversed(b))])
    terms = ", ".join(f"a[{i}] + (b[{k - 1 - i}] & hi)" for i in range(k))
    return eval(f"lambda a, b, hi: sorted(({terms},))")  # the source is built from k alone


# Once few states are left (fewer than ``_TAIL_SETS / k``), or a round keeps only a few pairs (the process has
# become sequential), numpy's per-call overhead outweighs its vector width: the rest is merged with a plain
# heap on Python ints.
def _python_tail(states: np.ndarray, key: np.ndarray, shift: int, mask: int, merges: _Merges) -> np.ndarray:
    """Finish a few full states with a plain heap on Python ints (cheaper than numpy calls)."""
    hi = ~mask
    merge = _merge_fn(states.shape[1])
    heap = [(kk, -row[-1], row) for kk, row in zip((key >> shift).tolist(), states.tolist())]
    heapq.heapify(heap)
    pop, replace = heapq.heappop, heapq.heapreplace
    absorbed: list[int] = []
    absorbing: list[int] = []
    while len(heap) > 1:
        first = pop(heap)[2]
        second = heap[0][2]
        merged = merge(first, second, hi)
        absorbed += second
        absorbing += first[::-1]
        replace(heap, ((merged[0] >> shift) - (merged[-1] >> shift), -merged[-1], merged))
    merges.add(np.array(absorbed, dtype=np.int64), np.array(absorbing, dtype=np.int64), len(states) - 1)
    return np.array(heap[0][2], dtype=np.int64)


# equal_size=True (every state starts full): instead of n/k heap operations, ~log(n/k) rounds of a dozen
# numpy calls. All states are sorted by heap priority and paired (1st with 2nd, 3rd with 4th, ...); the
# pairs are merged at once, and the longest prefix of pairs that the heap would really have popped in
# that order (no merged state outranks a later pair) is kept.
def _rounds(states: np.ndarray, shift: int, mask: int, merges: _Merges) -> np.ndarray:
    """Merge full states (no empty set) in vectorised rounds until one is left.

    Args:
        states: Encoded states ``[m, k]``, each row ascending, no zero entry.
        shift: Bit position of the sum field.
        mask: Mask of the gid field.
        merges: Merge records, appended to.

    Returns:
        The final state ``[k]`` (encoded, ascending).
    """
    k = states.shape[1]
    # A round costs about as much as _ROUND_COST / (1 + k / 8) Python-heap merges; below that many
    # accepted pairs per round (or this few states) the Python heap finishes faster.
    tail = max(4, _TAIL_SETS // k)
    min_keep = _ROUND_COST * 8 / (8 + k)
    hi = ~mask  # sum and count fields: what a merge adds
    sums = -(1 << shift)  # the sum field alone
    lexsort, running_min, concat = np.lexsort, np.minimum.accumulate, np.concatenate
    # keys are -spread << shift (smaller pops first); ties: the larger top set pops first
    key = (states[:, 0] & sums) - (states[:, -1] & sums)
    while key.shape[0] > tail:
        order = lexsort((-states[:, -1], key))
        pairs = key.shape[0] // 2
        pair = states[order[: 2 * pairs]].reshape(pairs, 2, k)
        first = pair[:, 0]
        rev = pair[:, 1, ::-1]  # heaviest of `first` meets the lightest of the second state
        merged = first + (rev & hi)
        merged.sort(axis=1)
        mkey = (merged[:, 0] & sums) - (merged[:, -1] & sums)
        # pair j was popped as a pair only if no earlier merged state outranks its second state
        ok = running_min(mkey[:-1]) > key[order[3 : 2 * pairs : 2]]
        bad = ok.argmin()
        if pairs > 1 and not ok[bad]:
            keep = bad + 1
            merged, mkey, first, rev = merged[:keep], mkey[:keep], first[:keep], rev[:keep]
        merges.add(rev, first)
        rest = order[2 * mkey.shape[0] :]
        states = concat((merged, states[rest]))
        key = concat((mkey, key[rest]))
        if mkey.shape[0] < min_keep:  # a poor round: the rest is (nearly) sequential
            break
    if key.shape[0] > 1:
        return _python_tail(states, key, shift, mask, merges)
    return states[0]


# equal_size=False (every state starts as one item): a state that still has empty sets keeps its priority
# while it absorbs single items, so whole runs of items are absorbed in one step (``searchsorted``). Once
# only full states are left the rest is the equal_size process, done in rounds too.
def _heap(enc: np.ndarray, k: int, shift: int, mask: int, merges: _Merges) -> np.ndarray:
    """equal_size=False: heap of merged states plus the descending stream of single items.

    Args:
        enc: Encoded items sorted ascending ``[n]``.
        k: Sets per state.
        shift: Bit position of the sum field.
        mask: Mask of the gid field.
        merges: Merge records, appended to.

    Returns:
        The final state ``[k]`` (encoded, ascending).
    """
    stream = enc[::-1]  # descending = ascending heap priority of single-item states
    neg_stream = -stream  # ascending, for searchsorted
    stream_list = stream.tolist()
    n = len(stream_list)
    pos = 0
    heap: list[tuple[int, int, int, np.ndarray]] = []
    seq = 0

    def state_key(state: np.ndarray) -> tuple[int, int]:
        top = int(state[-1])
        return (int(state[0]) >> shift) - (top >> shift), -top

    def pop() -> np.ndarray:
        nonlocal pos
        if pos < n and (not heap or (-(stream_list[pos] >> shift), -stream_list[pos]) < heap[0][:2]):
            state = np.zeros(k, dtype=np.int64)
            state[-1] = stream_list[pos]
            pos += 1
            return state
        return heapq.heappop(heap)[3]

    def singles_before_heap_top() -> int:
        """How many stream items the heap would pop before its current top state."""
        if not heap:
            return n - pos
        neg_spread, neg_top = heap[0][:2]
        threshold = min((-neg_spread + 1) << shift, -neg_top + 1)
        return int(np.searchsorted(neg_stream, -threshold, side="right")) - pos

    remaining = n
    cur: np.ndarray | None = None  # a state known to be the next one popped
    try_rounds = True
    while remaining > 1:
        if cur is None and pos == n and try_rounds:
            # only full states left: the rest is the equal_size process, done in vectorised rounds
            if all(entry[3][0] != 0 for entry in heap):
                return _rounds(np.stack([entry[3] for entry in heap]), shift, mask, merges)
            try_rounds = False
        if cur is None:
            cur = pop()
        empties = int(np.searchsorted(cur, 1))  # encoded 0 == empty set; rows are ascending
        take = min(empties, singles_before_heap_top()) if empties else 0
        if take:
            # absorbing single items into empty sets keeps cur's priority: do a whole run at once
            cur[:take] = stream[pos : pos + take]
            cur.sort()
            pos += take
            remaining -= take
        else:
            second = pop()[::-1]
            g1 = cur & mask
            g2 = second & mask
            both = (g1 != 0) & (g2 != 0)
            if both.any():
                merges.add(g2[both], g1[both])
            cur = np.where(g1 == 0, second, cur + (second & ~mask))
            cur.sort()
            remaining -= 1
        if remaining > 1:
            ckey = state_key(cur)
            nxt = heap[0][:2] if heap else None
            if pos < n:
                skey = (-(stream_list[pos] >> shift), -stream_list[pos])
                nxt = skey if nxt is None or skey < nxt else nxt
            if nxt is not None and not ckey < nxt:
                heapq.heappush(heap, (*ckey, seq, cur))
                seq += 1
                cur = None
    return pop() if cur is None else cur


def kk_partition(values: np.ndarray, k: int, equal_size: bool) -> list[list[int]]:
    """Karmarkar-Karp partition of ``values`` into ``k`` sets.

    Args:
        values: Non-negative ``int64`` values ``[n]``, ``n >= k`` (and ``n % k == 0`` if
            ``equal_size``); the caller validates.
        k: Number of partitions.
        equal_size: Give every partition ``n // k`` items.

    Returns:
        ``k`` lists of item indices, each sorted ascending, ordered by partition sum descending.
    """
    n = values.shape[0]
    if k == 1:
        return [list(range(n))]
    # A set is one int64 of bit fields ``sum | count | gid`` (gid = 1 + index of the set's first item, 0 =
    # empty), so sorting encoded values orders sets by (sum, item count, first index): the textbook order,
    # with no Python object per set. Merging adds the second set's sum and count to the first (which keeps
    # its gid) and records parent[gid_2] = gid_1; membership is resolved once at the end by pointer jumping.
    gid_bits = n.bit_length()
    max_count = n // k if equal_size else n - k + 1
    count_bits = max_count.bit_length()
    sum_bits = (int(values.max()) * max_count).bit_length()  # bounds every set's sum
    if sum_bits + count_bits + gid_bits > 62:
        sum_bits = min(sum_bits, int(values.astype(object).sum()).bit_length())  # exact, no wrap-around
        if sum_bits + count_bits + gid_bits > 62:
            count_bits = 0  # drop the item-count tie-break before losing precision
    overflow = sum_bits + count_bits + gid_bits - 62
    if overflow > 0:
        values = values >> overflow
    shift = gid_bits + count_bits
    mask = (1 << gid_bits) - 1
    order = stable_argsort(values)
    one = 1 << gid_bits if count_bits else 0
    enc = (values[order] << shift) | (order + (one + 1))
    merges = _Merges()
    if equal_size:
        final = _rounds(enc.reshape(-1, k), shift, mask, merges)
    else:
        final = _heap(enc, k, shift, mask, merges)
    roots = merges.roots(n, mask)[1:]  # root gid of every item
    # items grouped by root gid (ascending), each group in index order
    grouped = np.argsort(roots.astype(np.uint16) if n < 65536 else roots, kind="stable").tolist()
    heaviest_first = (final & mask).tolist()[::-1]
    by_gid = sorted(heaviest_first)
    if equal_size:
        sizes = [n // k] * k
    else:
        sizes = np.bincount(roots, minlength=n + 1)[by_gid].tolist()
    start = dict(zip(by_gid, accumulate([0, *sizes[:-1]])))
    size = dict(zip(by_gid, sizes))
    return [grouped[start[g] : start[g] + size[g]] for g in heaviest_first]
