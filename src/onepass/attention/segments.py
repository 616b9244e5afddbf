"""The segment plan: a row cut into segments for the CPU attention kernel, in O(L), never L x L.

Why this module exists: :mod:`onepass.attention.cpu_tiles` runs a dense fused kernel on
tiles; this plan says which tiles cover exactly the visible pairs. (The tile plan
for FlexAttention is :mod:`onepass.attention.blocks`.) Same one rule::

    query q may attend to key k   <=>   k <= q < kv_end[k]

Worked example (the layout of :mod:`onepass.attention.blocks`): ``h h t t r r r r``
with ``kv_end = 8 8 4 4 8 8 8 8``.

A *segment* (:mod:`onepass.layout.geometry`, where it is told apart from the mixers'
*chain*) is a maximal run of consecutive positions in which each node's parent
is the previous position (p - 1 is the parent of p iff ``kv_end[p - 1] > p``).
The queries of a segment [s, e) see exactly its own keys causally and the
ancestors of s, all of them (subtrees nest). Here: segment [0, 4) ``h h t t``
has no ancestors; segment [4, 8) ``r r r r`` sees ancestors [0, 2) ``h h``.
Each segment is cut into query chunks of ``chunk`` tokens; chunk [a, b) of
segment [s, e) is a causal square on its own diagonal and a no-mask rectangle
against its own earlier keys [s, a) (contiguous in the row: a view), and the
whole segment is one no-mask rectangle against its ancestors (one gather, one
call, however many chunks)::

    segment [4, 8), chunk 2:   rectangle q [4, 8) x k (0 1)         (its ancestors)
                               diagonal  q [4, 6) x k [4, 6) causal
                               diagonal  q [6, 8) x k [6, 8) causal
                               rectangle q [6, 8) x k [4, 6)        (its earlier chunk)

Sliding windows (``pos[q] - pos[k] < W``, see :mod:`onepass.attention.window`): a
segment's keys (ancestors, then its own positions) are exactly
  the path from the root, so key j of the list has depth j and query q (list
  index depth[q]) sees keys (depth[q] - W, depth[q]]: a band. Chunks are cut
  to at most W - 1 queries, so a diagonal square is never cut by the window
  and every query of a chunk still sees the key just before it; each chunk
  has one rectangle (no separate ancestor one), over keys
  [depth[q0] - W + 1, depth[q0]) of the list, with a mask
  (:meth:`SegmentPlan.rect_visible`) where the window cuts it.

Legend: B rows, L row length, S segments, T = B * L (rows flattened into one), G chunks
in a bucket, C bucket width, R rectangles. Numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from onepass.attention.blocks import as_kv_end_BL
from onepass.attention.window import check_window, window_start
from onepass.layout.geometry import segments


@dataclass(frozen=True, kw_only=True, slots=True)
class SegmentPlan:
    """Rows flattened to T = B * L positions, as segments and the tiles that cover their visible pairs.

    seg_start_S, seg_stop_S  int64 [S]: segment i is [start, stop)
    anc_ptr_S1, anc_index    ancestors of segment i: anc_index[anc_ptr[i]:anc_ptr[i + 1]], ascending
    diag_runs_R3             int64 [R, 3]: (start, n, width): n consecutive diagonal chunks of width
    diag_buckets             int64 [G, C] each: the other diagonal chunks, -1 past a chunk's end
    rect_R4                  int64 [R, 4]: (segment, query start, query stop, key stop), keys taken from
                             ancestors + own positions of the segment, in that order
    rect_lo_R                int64 [R]: the rectangle's first key in that list. Without a window: 0 for a
                             segment's one rectangle against its ancestors (key stop = their number),
                             else the number of ancestors (a chunk against its own earlier positions)
    window                   the sliding window (in positions) the plan was cut for, or None
    """

    num_rows: int
    row_length: int
    chunk: int
    seg_start_S: np.ndarray
    seg_stop_S: np.ndarray
    anc_ptr_S1: np.ndarray
    anc_index: np.ndarray
    diag_runs_R3: np.ndarray
    diag_buckets: tuple[np.ndarray, ...]
    rect_R4: np.ndarray
    rect_lo_R: np.ndarray
    window: int | None = None

    @property
    def num_segments(self) -> int:
        return len(self.seg_start_S)

    @property
    def num_kernel_calls(self) -> int:
        """Attention kernel calls per layer and direction (forward or backward)."""
        return len(self.diag_runs_R3) + len(self.diag_buckets) + len(self.rect_R4)

    @property
    def visible_pairs(self) -> int:
        """Visible (query, key) pairs of the mask (what the tiles compute, up to bucket padding).

        Counted from the segments; equals :func:`onepass.layout.flops.visible_pairs` of ``kv_end``
        (``tests/layout/test_flops.py``).
        """
        n_S = self.seg_stop_S - self.seg_start_S
        return int((n_S * (n_S + 1) // 2).sum() + (n_S * np.diff(self.anc_ptr_S1)).sum())

    def keys(self, i: int) -> np.ndarray:
        """Key positions of segment i's rectangles: its ancestors, then its own positions."""
        anc = self.anc_index[self.anc_ptr_S1[i]:self.anc_ptr_S1[i + 1]]
        return np.concatenate([anc, np.arange(self.seg_start_S[i], self.seg_stop_S[i])])

    def rect_visible(self, r: int) -> np.ndarray | None:
        """Bool ``[n, keys]``: the pairs of rectangle r the window keeps; None when it keeps them all.

        Query ``q0 + a`` has list index ``key stop + a`` (its depth) and sees list indices
        above ``key stop + a - window``.
        """
        if self.window is None:
            return None
        _, q0, q1, hi = self.rect_R4[r].tolist()
        lo = int(self.rect_lo_R[r])
        if lo > hi + (q1 - q0 - 1) - self.window:  # even the last query sees the first key
            return None
        return np.arange(lo, hi)[None, :] > (hi + np.arange(q1 - q0))[:, None] - self.window


def segment_plan(kv_end: Any, *, chunk: int = 128, position_ids: Any = None,
                 window: int | None = None) -> SegmentPlan:
    """Segments, ancestors and tiles of ``kv_end`` ([L] or [B, L]) in O(L + S log L).

    With a sliding ``window`` (``position_ids`` shaped like ``kv_end``), chunks
    are at most ``window - 1`` queries and rectangles start at the window.
    Raises ValueError when subtrees do not nest (not a tree layout): the plan
    relies on it.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    kv_end_BL = as_kv_end_BL(kv_end)
    if window is not None:
        window = check_window(window)
        window_start(kv_end_BL, position_ids, window)  # checks positions = depths
        chunk = min(chunk, max(window - 1, 1))  # every query of a chunk sees the key just before it
    B, L = kv_end_BL.shape
    segs = segments(kv_end_BL)  # ValueError unless subtrees nest: the plan relies on it
    start_S, stop_S, anc_ptr_S1, anc_index = segs.start_S, segs.stop_S, segs.anc_ptr_S1, segs.anc_index
    S = segs.num_segments
    num_anc_S = segs.num_ancestors_S

    # tiles: chunks of each segment; a diagonal square each, a rectangle where there are earlier keys
    n_S = stop_S - start_S
    num_chunks_S = -(-n_S // chunk)
    seg_R = np.repeat(np.arange(S), num_chunks_S)
    first_R = np.arange(len(seg_R)) - np.repeat(np.cumsum(num_chunks_S) - num_chunks_S, num_chunks_S)
    q0_R = start_S[seg_R] + first_R * chunk
    q1_R = np.minimum(q0_R + chunk, stop_S[seg_R])
    keys_R = num_anc_S[seg_R] + (q0_R - start_S[seg_R])  # = depth of q0: the list is the root path
    if window is None:  # one rectangle of the whole segment against its ancestors; chunks against own keys
        lo_R = num_anc_S[seg_R]
        anc = np.flatnonzero(num_anc_S)
        seg_R = np.concatenate([anc, seg_R])
        q0_R, q1_R = np.concatenate([start_S[anc], q0_R]), np.concatenate([stop_S[anc], q1_R])
        keys_R, lo_R = np.concatenate([num_anc_S[anc], keys_R]), np.concatenate([np.zeros_like(anc), lo_R])
    else:  # the chunk's own window of the root path
        lo_R = np.maximum(keys_R - window + 1, 0)
    order = np.argsort(seg_R, kind="stable")
    seg_R, q0_R, q1_R, keys_R, lo_R = seg_R[order], q0_R[order], q1_R[order], keys_R[order], lo_R[order]
    rect_R4 = np.stack([seg_R, q0_R, q1_R, keys_R], axis=1)[keys_R > lo_R]
    # diagonals: the whole chunks of a segment are one batch (a strided view of the row); the rest
    # (short segments, last chunks) run in buckets of similar width, padded at the end (a causal
    # query never sees a later key)
    num_whole_S = n_S // chunk
    whole = np.flatnonzero(num_whole_S)
    runs_R3 = np.stack([start_S[whole], num_whole_S[whole], np.full(len(whole), chunk)], axis=1)
    rest_q0 = start_S + num_whole_S * chunk
    rest = np.flatnonzero(rest_q0 < stop_S)
    width_R = stop_S[rest] - rest_q0[rest]
    bucket_R = np.where(width_R == 1, 1, np.minimum(chunk, -(-width_R // 16) * 16))
    buckets = []
    for width in np.unique(bucket_R).tolist():
        sel = rest[bucket_R == width]
        idx_GC = rest_q0[sel, None] + np.arange(width)
        buckets.append(np.where(idx_GC < stop_S[sel, None], idx_GC, -1))
    return SegmentPlan(num_rows=B, row_length=L, chunk=chunk, seg_start_S=start_S, seg_stop_S=stop_S,
                       anc_ptr_S1=anc_ptr_S1, anc_index=anc_index, diag_runs_R3=runs_R3.reshape(-1, 3),
                       diag_buckets=tuple(buckets), rect_R4=rect_R4, rect_lo_R=lo_R[keys_R > lo_R],
                       window=window)


def plan_pairs_reference(plan: SegmentPlan) -> np.ndarray:
    """Slow check of a plan: int [T, T], how many tiles compute each (query, key) pair (must be 0/1;
    pairs a rectangle's window mask hides are not counted)."""
    T = plan.num_rows * plan.row_length
    count = np.zeros((T, T), dtype=np.int64)
    for start, num, width in plan.diag_runs_R3.tolist():
        for a in range(start, start + num * width, width):
            count[a:a + width, a:a + width] += np.tri(width, dtype=np.int64)
    for idx_GC in plan.diag_buckets:
        for idx in idx_GC:
            idx = idx[idx >= 0]
            count[np.ix_(idx, idx)] += np.tri(len(idx), dtype=np.int64)
    for r, (i, q0, q1, num_keys) in enumerate(plan.rect_R4.tolist()):
        visible = plan.rect_visible(r)
        count[q0:q1, plan.keys(i)[plan.rect_lo_R[r]:num_keys]] += 1 if visible is None else visible
    return count
