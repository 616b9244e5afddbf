"""A compacted vocabulary: the token ids that occur, renumbered 0..V-1.

Why this module exists: ``verify``, ``bench`` and ``train --tiny`` run a tiny
random model on real data. With the real 151k-token vocabulary its embedding
and LM head would be almost all of its parameters and time, yet only the ids
that occur matter: renumbering them 0..V-1 (one map for every sequence of a
run, so train and eval agree) changes no loss or gradient of the layout under
test. ``used[i]`` is the original id of new id ``i``; ``IGNORE`` targets stay
``IGNORE``.

    >>> import numpy as np
    >>> used = used_ids([np.array([7, 3, 7]), np.array([9, IGNORE])])
    >>> used.tolist(), remap(np.array([9, 7, IGNORE]), used).tolist()
    ([3, 7, 9], [2, 1, -100])

No torch here: numpy only.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from onepass.layout.tree import IGNORE, Layout


def used_ids(arrays: Iterable[np.ndarray]) -> np.ndarray:
    """The sorted distinct token ids in ``arrays`` (``IGNORE`` left out): the compacted vocabulary."""
    flat = [np.asarray(a, dtype=np.int64).ravel() for a in arrays]
    ids = np.unique(np.concatenate(flat)) if flat else np.zeros(0, dtype=np.int64)
    return ids[ids != IGNORE]


def remap(ids: np.ndarray, used: np.ndarray) -> np.ndarray:
    """``ids`` renumbered to their index in ``used`` (int64); ``IGNORE`` stays ``IGNORE``."""
    ids = np.asarray(ids)
    new = np.searchsorted(used, ids)
    keep = ids != IGNORE
    if keep.any():
        assert len(used) and (used[np.minimum(new[keep], len(used) - 1)] == ids[keep]).all(), \
            "an id outside the compacted vocabulary"
    return np.where(keep, new, IGNORE).astype(np.int64)


def layout_ids(layouts: Iterable[Layout]) -> list[np.ndarray]:
    """The token ids a layout holds: its inputs and its trained targets."""
    return [a for x in layouts for a in (x.input_ids, x.targets)]


def remap_layout(layout: Layout, used: np.ndarray) -> Layout:
    """``layout`` with its inputs and targets renumbered (positions, kv_end, weights unchanged)."""
    return Layout(input_ids=remap(layout.input_ids, used), position_ids=layout.position_ids,
                  kv_end=layout.kv_end, targets=remap(layout.targets, used), weights=layout.weights)
