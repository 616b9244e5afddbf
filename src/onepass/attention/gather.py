"""The gather plan: tree rows as one varlen call, each segment's queries against its gathered root path.

Why this module exists: a varlen kernel (FlashAttention-2's, ``torch.nn.attention.varlen.varlen_attn``)
computes causal attention inside each of many documents, and a one-pass row is a tree, not documents.
But a tree cut into *segments* (:class:`onepass.layout.geometry.Segments`) is documents in disguise: the
queries of segment i see exactly its ancestors' keys and its own, causally. Gather those keys into one
list per segment (ancestors first, then its own positions: the root path of its last node) and segment i
is a document with n_i queries and a_i + n_i keys, where query j sees keys 0 .. a_i + j. That is causal
attention aligned at the *bottom right* (queries shorter than keys, the last query sees the last key),
FlashAttention-2's own rule for ``is_causal`` when ``seqlen_q < seqlen_k``. So one varlen call computes the
whole tree mask, visible pairs only; the gather is an index (its backward, autograd's, is an index-add).
This module is the plan, host-side and numpy only; :mod:`onepass.attention.varlen` runs it.

Worked example (SCATTERED of ``tests/strategies.py``: a has three children, d two)::

    p        0  1  2  3  4   5   6             segment  queries   keys (gathered)    bottom-right causal
    token    h  a  b  d  d2  d3  f             0        h a b     h a b              q j sees keys <= j
    kv_end   7  7  3  6  5   6   7             1        d d2      h a | d d2         q j sees keys <= 2 + j
                                               2        d3        h a d | d3         q 0 sees keys <= 3
                                               3        f         h a | f            q 0 sees keys <= 2

    key_index = [0 1 2 | 0 1 3 4 | 0 1 3 5 | 0 1 6], cu_seqlens_q = [0 3 5 6 7], cu_seqlens_k = [0 3 7 11 14]

Sliding windows (``pos[q] - pos[k] < W``, :mod:`onepass.attention.window`): positions count the depth,
and the gathered list of a segment is a root path, so list index = depth: the kernel's own window
``(W - 1, 0)``, aligned at the bottom right like its causal rule, is the tree's window; a segment keeps
only its last ``W - 1`` ancestors (its first query sees no further back).

Rows that never branch (N-pass rows, padding) have no ancestors anywhere: their keys are their
queries, and the plan says so (``key_index`` None: no gather at all; each segment is one document).

Legend: B rows, L row length, T = B * L (rows flattened into one), S segments, K gathered keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from onepass.attention.window import check_window, window_start
from onepass.layout.geometry import segments


@dataclass(frozen=True, kw_only=True, slots=True)
class GatherPlan:
    """One varlen call over ``[B, L]`` rows flattened to T positions (queries in row order).

    cu_seqlens_q  int32 [S + 1]: segment i's queries are positions [cu_q[i], cu_q[i + 1])
    cu_seqlens_k  int32 [S + 1]: its keys are gathered[cu_k[i]:cu_k[i + 1]]
    key_index     int64 [K]: gathered = keys[key_index]; None when every segment's keys are its own
                  queries (no row branches): no gather
    max_q, max_k  the longest query and key runs (the kernel's launch bounds)
    window        the sliding window the plan was cut for (positions), or None
    """

    num_rows: int
    row_length: int
    cu_seqlens_q: np.ndarray
    cu_seqlens_k: np.ndarray
    key_index: np.ndarray | None
    max_q: int
    max_k: int
    window: int | None = None

    @property
    def num_segments(self) -> int:
        return len(self.cu_seqlens_q) - 1

    @property
    def num_keys(self) -> int:
        """Rows of the gathered K and V (T when there is no gather)."""
        return int(self.cu_seqlens_k[-1])

    @property
    def visible_pairs(self) -> int:
        """(query, key) pairs the call computes: n (n + 1) / 2 + n a per segment, window cuts applied.
        Equals :func:`onepass.layout.flops.visible_pairs` of the rows without a window (tests check it)."""
        n_S = np.diff(self.cu_seqlens_q).astype(np.int64)
        a_S = np.diff(self.cu_seqlens_k).astype(np.int64) - n_S
        if self.window is None:
            return int((n_S * (n_S + 1) // 2 + n_S * a_S).sum())
        seen = np.minimum(np.arange(int(n_S.max(initial=0)))[None, :] + 1 + a_S[:, None], self.window)
        return int(np.where(np.arange(seen.shape[1])[None, :] < n_S[:, None], seen, 0).sum())


def gather_plan(kv_end: Any, *, position_ids: Any = None, window: int | None = None) -> GatherPlan:
    """The :class:`GatherPlan` of ``kv_end`` ([L] or [B, L]); with a sliding ``window``, ``position_ids``
    (shaped like ``kv_end``) must count the depth (ValueError otherwise, as for every tree backend).
    ValueError unless every row is a tree."""
    kv_end_BL = np.asarray(kv_end, dtype=np.int64)
    kv_end_BL = kv_end_BL.reshape(-1, kv_end_BL.shape[-1])
    if window is not None:
        window = check_window(window)
        window_start(kv_end_BL, position_ids, window)  # checks positions = depths
    B, L = kv_end_BL.shape
    segs = segments(kv_end_BL)
    n_S = segs.stop_S - segs.start_S
    a_S = segs.num_ancestors_S
    if window is not None:
        a_S = np.minimum(a_S, window - 1)  # the first query sees back to depth - (W - 1)
    cu_q = np.concatenate([[0], np.cumsum(n_S)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(a_S + n_S)]).astype(np.int32)
    key_index = None
    if a_S.any():
        # per key slot: its segment, and its index in the segment's list (ancestors then own)
        seg_K = np.repeat(np.arange(segs.num_segments), a_S + n_S)
        j_K = np.arange(int(cu_k[-1])) - cu_k[:-1].astype(np.int64)[seg_K]
        own_K = j_K >= a_S[seg_K]
        # the kept ancestors are the last a_S of the segment's list
        anc_K = segs.anc_ptr_S1[1:][seg_K] - a_S[seg_K] + j_K
        anc_K = np.minimum(anc_K, len(segs.anc_index) - 1)  # own slots: any valid index, not used
        key_index = np.where(own_K, segs.start_S[seg_K] + j_K - a_S[seg_K], segs.anc_index[anc_K])
    return GatherPlan(num_rows=B, row_length=L, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, key_index=key_index,
                      max_q=int(n_S.max(initial=0)), max_k=int((a_S + n_S).max(initial=0)), window=window)


def plan_mask_reference(plan: GatherPlan) -> np.ndarray:
    """Slow check of a plan: bool [T, T], the (query, key) pairs its varlen call computes, by the kernel's
    bottom-right causal rule (and window) per segment, mapped back through ``key_index``."""
    T = plan.num_rows * plan.row_length
    keys = np.arange(T) if plan.key_index is None else plan.key_index
    out = np.zeros((T, T), dtype=bool)
    for i in range(plan.num_segments):
        q0, q1 = int(plan.cu_seqlens_q[i]), int(plan.cu_seqlens_q[i + 1])
        k0, k1 = int(plan.cu_seqlens_k[i]), int(plan.cu_seqlens_k[i + 1])
        n, m = q1 - q0, k1 - k0
        for j in range(n):
            last = j + m - n  # bottom right: the last query sees the last key
            first = 0 if plan.window is None else max(last - (plan.window - 1), 0)
            out[q0 + j, keys[k0 + first:k0 + last + 1]] = True
    return out
