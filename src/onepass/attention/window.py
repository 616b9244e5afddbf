"""Sliding windows over a tree layout: where each query's window starts.

Why this module exists: the N-pass rule of a windowed layer is ``q - k < W``
on token indices, which in a tree is ``pos[q] - pos[k] < W`` on top of the
tree rule (:mod:`onepass.attention.mask`). The dense masks and the
FlexAttention ``mask_mod`` apply that directly. The plans that skip work
(:mod:`onepass.attention.blocks`) need it in index form: position ids are
depths in the tree (plus a constant per tree), and the ancestors of a query
appear in DFS order with increasing depth, so the keys a query sees through
the window are its ancestors from one index on::

    query q may attend to key k   <=>   window_start[q] <= k <= q < kv_end[k]

where ``window_start[q]`` is q's ancestor at depth ``depth[q] - W + 1`` (its
root when q is shallower). Worked example (the tree of
:mod:`onepass.attention.mask`, W = 3)::

    p  token pos kv_end  depth  window_start
    0  h1    0   7       0      0  (h1)
    1  t1    1   3       1      0  (h1)
    2  r1    2   3       2      0  (h1)
    3  r1'   1   7       1      0  (h1)
    4  h2    2   7       2      0  (h1)
    5  t2    3   7       3      3  (r1': depth 1)
    6  r2    4   7       4      4  (h2: depth 2)

Depths and ancestors are :mod:`onepass.layout.geometry`'s. Numpy only, O(L log L) per row.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onepass.layout.geometry import ancestor_at, depths


def check_window(window: Any) -> int:
    """``window`` as an int >= 1, else ValueError."""
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"a sliding window must be an int >= 1, got {window!r}")
    return int(window)


def as_positions_BL(position_ids: Any, shape: tuple[int, int]) -> np.ndarray:
    """``position_ids`` (numpy / list / tensor) as int64 numpy shaped like ``kv_end`` (``[B, L]``)."""
    if position_ids is None:
        raise ValueError("a sliding window needs the rows' position_ids (it is measured in positions)")
    if hasattr(position_ids, "detach"):
        position_ids = position_ids.detach().cpu().numpy()
    pos = np.asarray(position_ids, dtype=np.int64)
    if pos.size != shape[0] * shape[1]:
        raise ValueError(f"position_ids of shape {pos.shape} do not match kv_end of shape {tuple(shape)}")
    return pos.reshape(shape)


def window_start(kv_end_BL: Any, position_ids: Any, window: int) -> np.ndarray:
    """``[B, L]``: the first key each query sees through a sliding ``window`` (``kv_end`` [L] or [B, L]).

    Raises ValueError unless ``position_ids`` are depths in the tree plus a constant per tree (what
    every onepass layout holds): only then is ``pos[q] - pos[k]`` the distance in q's view.
    """
    window = check_window(window)
    kv_end_BL = np.asarray(kv_end_BL, dtype=np.int64).reshape(-1, np.shape(kv_end_BL)[-1])
    B, L = kv_end_BL.shape
    pos_BL = as_positions_BL(position_ids, (B, L))
    depth_BL = depths(kv_end_BL)
    offset_BL = pos_BL - depth_BL
    bad_BL = np.zeros((B, L), dtype=bool)  # a node that is not a root sits one position after its parent
    bad_BL[:, 1:] = (depth_BL[:, 1:] > 0) & (offset_BL[:, 1:] != offset_BL[:, :-1])
    if bad_BL.any():
        b, p = np.argwhere(bad_BL)[0]
        raise ValueError(f"position_ids[{b}, {p}] = {pos_BL[b, p]} is not its parent's + 1: a sliding window "
                         "over a tree needs position ids that count the depth (as onepass layouts do)")
    return ancestor_at(kv_end_BL, np.maximum(depth_BL - window + 1, 0), node_depths=depth_BL)
