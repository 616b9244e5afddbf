"""Packing: several layouts per row, under a token budget, best-fit decreasing.

Why this module exists: rows of similar length waste no compute on padding,
and packed documents cost nothing extra because ``kv_end`` already keeps them
apart (see :func:`onepass.layout.tree.concat`). Best-fit decreasing: take layouts
longest first, put each into the open row with the least room left that still
fits it, else open a new row. Example, capacity 10, lengths 7 5 4 3 1::

    7 -> [7]          5 -> [7] [5]      4 -> [7] [5 4]
    3 -> [7 3] [5 4]  1 -> [7 3] [5 4 1]

No torch here: this is pure data.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from onepass.layout.tree import Layout, concat


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of item indices; every bin's total is <= ``capacity``. O(n log n) search.

    Items longer than ``capacity`` are a caller bug (they are filtered earlier).
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # sorted (room left, bin index)
    for i in order:
        n = lengths[i]
        assert n <= capacity, f"item {i} of length {n} exceeds capacity {capacity}"
        j = bisect.bisect_left(room, (n, -1))
        if j == len(room):
            bins.append([i])
            bisect.insort(room, (capacity - n, len(bins) - 1))
        else:
            left, b = room.pop(j)
            bins[b].append(i)
            bisect.insort(room, (left - n, b))
    return bins


def best_fit_reference(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Slow reference of :func:`best_fit_decreasing` (linear scan of the bins)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    totals: list[int] = []
    for i in order:
        fits = [(capacity - t, b) for b, t in enumerate(totals) if t + lengths[i] <= capacity]
        if fits:
            b = min(fits)[1]
            bins[b].append(i)
            totals[b] += lengths[i]
        else:
            bins.append([i])
            totals.append(lengths[i])
    return bins


def pack_layouts(layouts: Sequence[Layout], max_tokens: int) -> list[Layout]:
    """Rows of at most ``max_tokens`` tokens, each a concatenation of whole layouts."""
    bins = best_fit_decreasing([len(x) for x in layouts], max_tokens)
    return [concat([layouts[i] for i in b]) for b in bins]
