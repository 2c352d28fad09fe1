"""Split a rank's mini-batch into micro-batches: a fixed size, or a token budget (dynamic).

verl 0.9.1's names and semantics (``verl/utils/seqlen_balancing.py``: ``rearrange_micro_batches``,
``get_reverse_idx``, ``restore_dynamic_batch``; ``prepare_micro_batches`` of its engine). Invariants:

* Dynamic mode: every micro-batch fits the budget, and their count is never above verl's (the fewest
  :func:`min_micro_batches` finds); they are token-balanced where possible.
* Every DP rank runs the same number of micro-batches (FSDP gathers parameters in each forward: a rank with
  one fewer hangs the others): the MAX over the DP group, agreed in one all-reduce that also carries the
  longest sample, so a sample over the budget raises ``ValueError`` on every rank together.
* A rank with fewer samples than the agreed count gets padding micro-batches of one synthetic sample each
  (``core_algos.balancing.make_padding_samples``: one token, zero loss mask, ``is_padding``), marked ``-1``
  in the returned index list; :func:`restore_dynamic_batch` drops their rows. A rank with at least that
  many samples never gets an empty or padding micro-batch.

Sample lengths come from ``data["seq_len"]`` (else ``attention_mask.sum(-1)``). Figures against verl:
docs/benchmarks.md (dynamic micro-batching).

Groups: a batch with a ``group_id`` field (``verl_trainer.data.schema``; a preference pair) is planned over
its groups instead of its samples, so the samples of a group land in one micro-batch: dynamic mode packs
groups by their token sums (a group longer than the budget is the same ``ValueError``), fixed mode takes
runs of whole groups of about ``micro_batch_size_per_gpu`` samples (a group larger than that is a
micro-batch of its own). Padding samples (``is_padding``) are groups of one. Without ``group_id`` nothing
changes.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from itertools import chain
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_trainer.core_algos.balancing import calculate_workload
from verl_trainer.core_algos.karmarkar_karp import kk_partition, stable_argsort
from verl_trainer.data import schema
from verl_trainer.utils.distributed import all_reduce

__all__ = [
    "get_reverse_idx",
    "micro_batch_lower_bound",
    "min_micro_batches",
    "plan_micro_batches",
    "prepare_micro_batches",
    "rearrange_micro_batches",
    "restore_dynamic_batch",
]

RowsT = TypeVar("RowsT", torch.Tensor, TensorDict)
BatchIndices = Sequence[int] | Sequence[Sequence[int]] | torch.Tensor
"""Original row indices: flat, one list per micro-batch, or a tensor."""


def _all_reduce_max(values: list[int], group: dist.ProcessGroup | None) -> list[int]:
    """Element-wise MAX of ``values`` over ``group`` (identity when not distributed)."""
    return all_reduce(torch.tensor(values, dtype=torch.int64), group, dist.ReduceOp.MAX).tolist()


def micro_batch_lower_bound(seq_lens: Sequence[int] | np.ndarray, budget: int) -> int:
    """Martello-Toth lower bound (L2) on the number of micro-batches of ``budget`` tokens.

    No packing of ``seq_lens`` into fewer micro-batches exists; a plan with this many is optimal. It
    is at least ``ceil(total / budget)`` and the number of samples longer than ``budget / 2``.
    """
    lens = np.asarray(seq_lens, dtype=np.int64)
    if lens.size == 0:
        return 0
    s = np.sort(lens)
    prefix = np.concatenate([[0], np.cumsum(s)])
    n = s.size
    half_hi = int(np.searchsorted(s, budget // 2, side="right"))  # s[half_hi:] > budget / 2
    alphas = np.unique(np.concatenate([[0], s[:half_hi]]))
    big = np.searchsorted(s, budget - alphas, side="right")
    lo = np.searchsorted(s, alphas, side="left")  # s[lo:half_hi] are in [alpha, budget/2]
    n1 = n - big  # > budget - alpha: a bin each, nothing else fits with them
    n2 = big - half_hi  # in (budget/2, budget - alpha]: a bin each, room budget - s left
    room = n2 * budget - (prefix[big] - prefix[half_hi])
    small = prefix[half_hi] - prefix[lo]
    extra = np.maximum(0, -(-(small - room) // budget))
    return int(max((n1 + n2 + extra).max(), -(-int(prefix[-1]) // budget)))


def _first_fit_decreasing(lens: np.ndarray, budget: int) -> list[list[int]]:
    """First-fit-decreasing bin packing of items ``lens`` (each <= budget) into bins of ``budget``."""
    order = stable_argsort(int(lens.max()) - lens).tolist()
    room = np.full(len(order) + 1, budget, dtype=np.int64)
    bins: list[list[int]] = []
    for i in order:
        size = int(lens[i])
        j = int(np.argmax(room >= size))
        room[j] -= size
        if j == len(bins):
            bins.append([])
        bins[j].append(i)
    return bins


def min_micro_batches(seq_lens: Sequence[int] | np.ndarray, budget: int) -> list[list[int]]:
    """The fewest micro-batches (index lists) whose token sums all fit ``budget``.

    First-fit-decreasing; if that is above the Martello-Toth lower bound, Karmarkar-Karp is tried at
    every smaller count (the first fit wins), which makes the count never exceed verl's
    (Karmarkar-Karp from ``ceil(total / budget)`` up until it fits).

    Args:
        seq_lens: Non-negative lengths ``[n]``, each ``<= budget``.
        budget: Token budget per micro-batch.

    Returns:
        Index lists, each sorted, whose length sums are ``<= budget`` (``[]`` for no samples).
    """
    lens = np.asarray(seq_lens, dtype=np.int64)
    if lens.size == 0:
        return []
    if int(lens.max()) > budget:
        raise ValueError(f"a sample of {int(lens.max())} tokens does not fit a budget of {budget}")
    best = _first_fit_decreasing(lens, budget)
    trivial = -(-int(lens.sum()) // budget)
    lower = trivial if len(best) == trivial else micro_batch_lower_bound(lens, budget)
    for count in range(lower, len(best)):
        parts = kk_partition(lens, count, equal_size=False)
        if max(int(lens[p].sum()) for p in parts) <= budget:
            best = parts
            break
    return [sorted(b) for b in best]


def _split_to(bins: list[list[int]], lens: np.ndarray, num: int) -> list[list[int]]:
    """Split the heaviest multi-item bins in two until there are ``num`` bins (``num <= n``)."""
    heap = [(-int(lens[b].sum()), i, b) for i, b in enumerate(bins)]
    heapq.heapify(heap)
    done: list[list[int]] = []
    seq = len(bins)
    while len(heap) + len(done) < num:
        _, _, b = heapq.heappop(heap)
        if len(b) < 2:
            done.append(b)
            continue
        halves: list[list[int]] = [[], []]
        sums = [0, 0]
        for i in sorted(b, key=lambda i: -int(lens[i])):
            h = 0 if sums[0] <= sums[1] else 1
            halves[h].append(i)
            sums[h] += int(lens[i])
        for h in (0, 1):
            heapq.heappush(heap, (-sums[h], seq, halves[h]))
            seq += 1
    return done + [b for _, _, b in heap]


def _partition(lens: np.ndarray, budget: int, num: int, packing: list[list[int]]) -> list[list[int]]:
    """``num`` non-empty bins within ``budget``, token-balanced where possible (``num < n``)."""
    parts = kk_partition(lens, num, equal_size=False)
    if max(int(lens[p].sum()) for p in parts) <= budget:
        return parts
    return [sorted(b) for b in _split_to(packing, lens, num)]


def _order_small_large_small(parts: list[list[int]], lens: np.ndarray) -> list[list[int]]:
    """Sort by workload, largest in the middle, smallest at both ends (short pipeline bubbles)."""
    work = calculate_workload(lens)
    ranked = sorted(parts, key=lambda p: (-int(work[p].sum()), p[0]))
    return ranked[::2][::-1] + ranked[1::2]


def plan_micro_batches(
    seq_lens: Sequence[int] | np.ndarray,
    budget: int,
    num: int | None = None,
    packing: list[list[int]] | None = None,
    balance_order: bool = True,
) -> list[list[int]]:
    """Index lists of ``num`` micro-batches within ``budget`` (the planning of the dynamic mode).

    Args:
        seq_lens: Lengths ``[n]``, each ``<= budget``.
        budget: Token budget per micro-batch.
        num: Number of micro-batches (``None``: the fewest, :func:`min_micro_batches`); it must be at
            least that. ``num > n`` leaves ``num - n`` micro-batches empty (the caller pads them).
        packing: A feasible packing with ``<= num`` bins, if already computed.
        balance_order: Order small-large-small by workload, else by first index.

    Returns:
        ``min(num, n)`` non-empty sorted index lists whose token sums are ``<= budget``.
    """
    lens = np.asarray(seq_lens, dtype=np.int64)
    if packing is None:
        packing = min_micro_batches(lens, budget)
    num = len(packing) if num is None else num
    if num < len(packing):
        raise ValueError(
            f"{lens.size} samples need at least {len(packing)} micro-batches of {budget} tokens, not {num}"
        )
    parts = _partition(lens, budget, num, packing) if num < lens.size else [[i] for i in range(lens.size)]
    return _order_small_large_small(parts, lens) if balance_order else sorted(parts)


def rearrange_micro_batches(
    batch: TensorDict,
    max_token_len: int,
    dp_group: dist.ProcessGroup | None = None,
    num_batches_divided_by: int | None = None,
    same_micro_num_in_dp: bool = True,
    min_num_micro_batch: int | None = None,
    use_dynamic_bsz_balance: bool = True,
) -> tuple[list[TensorDict], list[list[int]]]:
    """Dynamic micro-batches: the fewest whose token sums fit ``max_token_len``, same count on every rank.

    Args:
        batch: A rank's batch ``[B]``.
        max_token_len: Token budget per micro-batch (the engine passes
            ``max_token_len_per_gpu * sp_size``).
        dp_group: Process group whose ranks must agree on the count (``None``: the default group when
            torch.distributed is initialised).
        num_batches_divided_by: Round the count up to a multiple of this (pipeline stages).
        same_micro_num_in_dp: Agree on the count (MAX) over ``dp_group``; also checks the budget on all
            ranks together.
        min_num_micro_batch: At least this many micro-batches.
        use_dynamic_bsz_balance: Order micro-batches small-large-small by workload; otherwise by their
            first sample index.

    Returns:
        ``(micro_batches, indices)``: each micro-batch is ``batch[indices[i]]``; an index ``-1`` marks
        a padding sample (only on a rank with fewer samples than the agreed count).

    Raises:
        ValueError: On every rank of ``dp_group`` if a sample on any of them is longer than
            ``max_token_len``.
    """
    if not isinstance(max_token_len, (int, np.integer)) or max_token_len < 1:
        raise ValueError(f"max_token_len must be a positive integer, got {max_token_len!r}")
    lens = schema.sample_sizes(batch).detach().cpu().numpy()
    n = lens.size
    local_max = int(lens.max()) if n else 0
    packing = min_micro_batches(lens, max_token_len) if local_max <= max_token_len else []
    global_max, num = local_max, len(packing)
    if same_micro_num_in_dp:
        global_max, num = _all_reduce_max([local_max, num], dp_group)
    if global_max > max_token_len:
        raise ValueError(
            f"a sample of {global_max} tokens is longer than the micro-batch token budget "
            f"{max_token_len} (max_token_len_per_gpu * sp_size; the longest sample on this rank has "
            f"{local_max}); raise max_token_len_per_gpu or truncate the sequences"
        )
    num = max(num, min_num_micro_batch or 0)
    if num_batches_divided_by:
        num = -(-num // num_batches_divided_by) * num_batches_divided_by
    parts = plan_micro_batches(lens, max_token_len, num, packing, use_dynamic_bsz_balance)
    # one gather in micro-batch order, then contiguous views
    flat = torch.as_tensor([i for p in parts for i in p], dtype=torch.long)
    micro = list(batch[flat].split([len(p) for p in parts])) if parts else []
    if num > n:
        pad = schema.padding_samples(batch, 1)
        micro += [pad] * (num - n)
        parts += [[-1]] * (num - n)
    return micro, parts


def _fixed_micro_batches(
    data: TensorDict, size: int, dp_group: dist.ProcessGroup | None, same_micro_num_in_dp: bool,
    min_num: int | None,
) -> tuple[list[TensorDict], list[int] | None]:
    """Contiguous slices of ``size``; more (smaller, or padding) ones if the group needs more."""
    n = data.batch_size[0]
    num = -(-n // size)
    if same_micro_num_in_dp:
        (num,) = _all_reduce_max([num], dp_group)
    num = max(num, min_num or 0)
    if num == -(-n // size):
        return list(data.split(size)) if n else [], None
    if n >= num:  # more micro-batches than needed: split evenly, order unchanged
        bounds = np.linspace(0, n, num + 1).round().astype(int).tolist()
        return [data[bounds[i] : bounds[i + 1]] for i in range(num)], None
    pad = schema.padding_samples(data, 1)
    micro = [data[i : i + 1] for i in range(n)] + [pad] * (num - n)
    return micro, list(range(n)) + [-1] * (num - n)


def prepare_micro_batches(
    data: TensorDict,
    dp_group: dist.ProcessGroup | None = None,
    same_micro_num_in_dp: bool = True,
    micro_batch_size_per_gpu: int | None = None,
    use_dynamic_bsz: bool = False,
    max_token_len_per_gpu: int | None = None,
    sp_size: int = 1,
    min_num_micro_batch: int | None = None,
) -> tuple[list[TensorDict], list[int] | None]:
    """Split a rank's batch into micro-batches, the same number on every DP rank.

    Args:
        data: The rank's batch ``[B]`` (padded token fields ``[B, T]``).
        dp_group: Data-parallel process group (``None``: the default group if initialised).
        same_micro_num_in_dp: Agree on the count by MAX over ``dp_group`` (one all-reduce).
        micro_batch_size_per_gpu: Fixed mode: samples per micro-batch.
        use_dynamic_bsz: Dynamic mode: fewest micro-batches within the token budget.
        max_token_len_per_gpu: Dynamic mode: tokens per micro-batch per GPU; the budget is this times
            ``sp_size`` (each SP rank holds ``1 / sp_size`` of a packed micro-batch).
        sp_size: Ulysses sequence-parallel size.
        min_num_micro_batch: At least this many micro-batches.

    Returns:
        ``(micro_batches, indices)``. Fixed mode: contiguous slices of ``data`` and ``None`` (order
        unchanged). Dynamic mode: the micro-batches and the original sample index of each of their
        rows, flattened in micro-batch order; pass it to :func:`restore_dynamic_batch` to put outputs
        back in order. ``-1`` marks a padding sample (a rank with fewer samples than the count). A batch
        with ``group_id`` is split by whole groups (module docstring) and always returns the index list.

    Raises:
        ValueError: For missing/invalid sizes, or (dynamic, on every rank) a sample over the budget.
    """
    if not isinstance(sp_size, (int, np.integer)) or sp_size < 1:
        raise ValueError(f"sp_size must be a positive integer, got {sp_size!r}")
    grouped = schema.GROUP_ID in data.keys()
    if use_dynamic_bsz:
        if not isinstance(max_token_len_per_gpu, (int, np.integer)) or max_token_len_per_gpu < 1:
            raise ValueError(
                f"use_dynamic_bsz=True needs max_token_len_per_gpu as a positive integer, "
                f"got {max_token_len_per_gpu!r}"
            )
        if grouped:
            return _grouped_micro_batches(data, dp_group, same_micro_num_in_dp, None,
                                          int(max_token_len_per_gpu) * int(sp_size), min_num_micro_batch)
        micro, parts = rearrange_micro_batches(
            data,
            int(max_token_len_per_gpu) * int(sp_size),
            dp_group=dp_group,
            same_micro_num_in_dp=same_micro_num_in_dp,
            min_num_micro_batch=min_num_micro_batch,
        )
        return micro, list(chain.from_iterable(parts))
    if not isinstance(micro_batch_size_per_gpu, (int, np.integer)) or micro_batch_size_per_gpu < 1:
        raise ValueError(
            f"fixed micro-batching needs micro_batch_size_per_gpu as a positive integer, got "
            f"{micro_batch_size_per_gpu!r} (or pass use_dynamic_bsz=True with max_token_len_per_gpu)"
        )
    if grouped:
        return _grouped_micro_batches(data, dp_group, same_micro_num_in_dp, int(micro_batch_size_per_gpu),
                                      None, min_num_micro_batch)
    return _fixed_micro_batches(
        data, int(micro_batch_size_per_gpu), dp_group, same_micro_num_in_dp, min_num_micro_batch
    )


def _expand(parts: list[list[int]], groups: list[list[int]]) -> list[list[int]]:
    return [sorted(i for g in part for i in groups[g]) for part in parts]


def _grouped_micro_batches(
    data: TensorDict, dp_group: dist.ProcessGroup | None, same_micro_num_in_dp: bool, size: int | None,
    budget: int | None, min_num: int | None,
) -> tuple[list[TensorDict], list[int]]:
    """Micro-batches of whole groups (module docstring): fixed (``size``) or dynamic (``budget``)."""
    groups = schema.sample_groups(data)
    lens = schema.sample_sizes(data).detach().cpu().numpy()
    group_lens = np.asarray([int(lens[g].sum()) for g in groups], dtype=np.int64)
    n = len(groups)
    local_max = int(group_lens.max()) if n else 0
    if budget is not None:
        packing = min_micro_batches(group_lens, budget) if local_max <= budget else []
        num = len(packing)
    else:
        runs: list[list[int]] = []
        for g, members in enumerate(groups):
            if not runs or sum(len(groups[h]) for h in runs[-1]) + len(members) > size:
                runs.append([])
            runs[-1].append(g)
        num = len(runs)
    global_max = local_max
    if same_micro_num_in_dp:
        global_max, num = _all_reduce_max([local_max, num], dp_group)
    if budget is not None and global_max > budget:
        raise ValueError(
            f"a sample group (group_id) of {global_max} tokens is longer than the micro-batch token budget "
            f"{budget} (max_token_len_per_gpu * sp_size; its samples must share a micro-batch); raise "
            "max_token_len_per_gpu or truncate the sequences"
        )
    num = max(num, min_num or 0)
    if budget is not None:
        parts = plan_micro_batches(group_lens, budget, num, packing)
    elif num == len(runs):
        parts = runs
    elif n >= num:  # more micro-batches than this rank's runs: split the groups evenly, order unchanged
        bounds = np.linspace(0, n, num + 1).round().astype(int).tolist()
        parts = [list(range(bounds[i], bounds[i + 1])) for i in range(num)]
    else:
        parts = [[g] for g in range(n)]
    rows = _expand(parts, groups)
    flat = torch.as_tensor([i for p in rows for i in p], dtype=torch.long)
    micro = list(data[flat].split([len(p) for p in rows])) if rows else []
    if num > len(rows):
        micro += [schema.padding_samples(data, 1)] * (num - len(rows))
        rows += [[-1]] * (num - len(rows))
    return micro, list(chain.from_iterable(rows))


def get_reverse_idx(idx_map: Sequence[int] | torch.Tensor) -> list[int] | torch.Tensor:
    """Inverse permutation: ``reverse[idx_map[i]] = i`` (a list for a list, a tensor for a tensor)."""
    if isinstance(idx_map, torch.Tensor):
        rev = torch.empty_like(idx_map)
        rev[idx_map] = torch.arange(idx_map.numel(), dtype=idx_map.dtype, device=idx_map.device)
        return rev
    idx = np.asarray(idx_map, dtype=np.int64)
    rev = np.empty_like(idx)
    rev[idx] = np.arange(idx.size)
    return rev.tolist()


def _flat_indices(batch_idx_list: BatchIndices) -> np.ndarray:
    if isinstance(batch_idx_list, torch.Tensor):
        return batch_idx_list.detach().cpu().long().reshape(-1).numpy()
    items = list(batch_idx_list)
    if items and isinstance(items[0], (list, tuple, np.ndarray, torch.Tensor)):
        items = [int(i) for i in chain.from_iterable(items)]  # one list per micro-batch
    return np.asarray(items, dtype=np.int64)


def _restore_tensor(data: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    if not data.is_nested:
        return data[rows.to(data.device)]
    offsets = data.offsets()
    rows = rows.to(offsets.device)
    starts, lengths = offsets[:-1][rows], offsets.diff()[rows]
    new_offsets = torch.zeros(rows.numel() + 1, dtype=offsets.dtype, device=offsets.device)
    new_offsets[1:] = torch.cumsum(lengths, 0)
    # position of every value in the new order: its row's old start + offset inside the row
    shift = torch.repeat_interleave(starts - new_offsets[:-1], lengths)
    gather = torch.arange(int(new_offsets[-1]), device=offsets.device) + shift
    return torch.nested.nested_tensor_from_jagged(data.values()[gather], new_offsets)


def restore_dynamic_batch(data: RowsT, batch_idx_list: BatchIndices) -> RowsT:
    """Put rows concatenated in micro-batch order back in the original sample order.

    Args:
        data: ``[N, ...]`` rows in micro-batch order: a dense tensor, a jagged nested tensor or a
            ``TensorDict``.
        batch_idx_list: The original index of each row, flat (``prepare_micro_batches``) or one list
            per micro-batch (``rearrange_micro_batches``); ``-1`` rows (padding) are dropped.

    Returns:
        The rows in original order, ``[N - #padding, ...]``, same kind as ``data``.
    """
    idx = _flat_indices(batch_idx_list)
    size = data.batch_size[0] if isinstance(data, TensorDict) else data.size(0)
    if idx.size != size:
        raise ValueError(f"restore_dynamic_batch: {size} rows but {idx.size} indices")
    keep = np.flatnonzero(idx >= 0)
    real = idx[keep]
    if not np.array_equal(np.sort(real), np.arange(real.size)):
        raise ValueError("restore_dynamic_batch: the indices are not a permutation of 0..n-1 (plus -1)")
    rows_np = np.empty(real.size, dtype=np.int64)
    rows_np[real] = keep
    rows = torch.from_numpy(rows_np)
    if isinstance(data, TensorDict):
        return data[rows.to(data.device) if data.device is not None else rows]
    return _restore_tensor(data, rows)
