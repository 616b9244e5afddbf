"""Static row lengths for a compiled attention kernel: a forward's rows as one row, padded to one of a few lengths.

Why this module exists: FlexAttention runs as a ``torch.compile``'d kernel, compiled again for every new
shape (tens of seconds each on a GPU), and past dynamo's recompile limit (8 shapes) torch gives up
compiling and runs flex unfused, materialising every score. One-pass forwards come in as many lengths
as there are conversations. So, for flex, the rows of a forward pass become one row
(:func:`onepass.layout.tree.concat`: documents never see each other, the loss is the same) padded
to the smallest *bucket* at least as long, the buckets chosen once, before training, from every
forward of the run (:func:`length_buckets`): each bucket compiles once, and no forward of the run
meets a length that is not one.

The choice: at most ``most`` lengths, multiples of ``block`` (FlexAttention's tile), the longest
forward's among them, that minimise the padded tokens of all the run's forwards. With each
forward going to the smallest bucket that holds it, that is a 1-D partition of the sorted lengths
(dynamic programming, O(most * n^2) over the n distinct block-rounded lengths). Worked example,
block 128, lengths 300 500 520 900 1000 (rounded 384 512 640 1024 1024), at most 2 buckets::

    buckets (640, 1024): 640 * 3 + 1024 * 2 = 3968 padded tokens   <- the least
    buckets (512, 1024): 512 * 2 + 1024 * 3 = 4096
    buckets (1024,)    : 1024 * 5          = 5120

No torch here. The slow reference is :func:`length_buckets_reference` (every subset).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

import numpy as np

from onepass.layout.tree import Layout, concat

BLOCK = 128  # FlexAttention's default tile (onepass.attention.mask): a bucket is whole tiles
MOST_BUCKETS = 4  # compiles per run at most; torch's recompile limit is 8 per compiled function


def _rounded(lengths: Sequence[int], block: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct block-rounded lengths, ascending, and how many forwards each holds."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0 or lengths.min() < 1:
        raise ValueError("length buckets need at least one forward, each at least one token long")
    return np.unique(-(-lengths // block) * block, return_counts=True)


def length_buckets(lengths: Sequence[int], *, most: int = MOST_BUCKETS, block: int = BLOCK) -> tuple[int, ...]:
    """At most ``most`` bucket lengths (multiples of ``block``, ascending) for forwards of ``lengths`` tokens,
    the fewest padded tokens in all; every length fits the last."""
    if most < 1:
        raise ValueError(f"most must be >= 1, got {most}")
    size_N, count_N = _rounded(lengths, block)
    N, K = len(size_N), min(most, len(size_N))
    held_N1 = np.concatenate([[0], np.cumsum(count_N)])  # forwards of the sizes below index j: held[j]
    # cost_KN[k, j]: the least padded tokens of the forwards up to size j with exactly k + 1 buckets, the last
    # at size j; from_KN[k, j]: the bucket before it
    cost_KN = np.full((K, N), np.iinfo(np.int64).max // 4)
    from_KN = np.full((K, N), -1)
    cost_KN[0] = size_N * held_N1[1:]
    for k in range(1, K):  # a bucket at j after one at i < j: cost[k - 1, i] + size[j] * (forwards in (i, j])
        cand_IJ = cost_KN[k - 1][:, None] + size_N[None, :] * (held_N1[None, 1:] - held_N1[1:, None])
        cand_IJ[np.tril_indices(N)] = np.iinfo(np.int64).max // 4
        from_KN[k] = cand_IJ.argmin(axis=0)
        cost_KN[k] = cand_IJ[from_KN[k], np.arange(N)]
    k, j = int(cost_KN[:, N - 1].argmin()), N - 1  # the fewest buckets among the least costs (argmin: first)
    chosen = []
    while j >= 0:
        chosen.append(int(size_N[j]))
        j, k = int(from_KN[k, j]), k - 1
    return tuple(sorted(chosen))


def length_buckets_reference(lengths: Sequence[int], *, most: int = MOST_BUCKETS,
                             block: int = BLOCK) -> tuple[int, ...]:
    """Slow, obviously correct: every set of at most ``most`` rounded lengths holding the longest, the one with
    the fewest padded tokens (ties: the fewest buckets, then the shortest)."""
    size_N, count_N = _rounded(lengths, block)
    top = int(size_N[-1])
    best = None
    for k in range(min(most, len(size_N))):
        for rest in itertools.combinations(size_N[:-1].tolist(), k):
            buckets = (*rest, top)
            cost = sum(int(c) * buckets[bisect.bisect_left(buckets, int(s))] for s, c in zip(size_N, count_N))
            if best is None or cost < best[0]:
                best = (cost, buckets)
    assert best is not None
    return tuple(best[1])


def bucket_of(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``length`` tokens (``buckets`` ascending); ValueError past the last."""
    i = bisect.bisect_left(buckets, length)
    if i == len(buckets):
        raise ValueError(f"a forward of {length} tokens is longer than the longest length bucket ({buckets[-1]}): "
                         "the buckets were chosen from other rows")
    return int(buckets[i])


def static_rows(rows: Sequence[Layout], buckets: Sequence[int]) -> tuple[list[Layout], int]:
    """A forward's ``rows`` as one row (documents side by side) and the bucket length to pad it to."""
    row = concat(rows) if len(rows) > 1 else rows[0]
    return [row], bucket_of(len(row), buckets)


__all__ = ["BLOCK", "MOST_BUCKETS", "bucket_of", "length_buckets", "length_buckets_reference", "static_rows"]
