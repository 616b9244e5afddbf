"""The tree a row's ``kv_end`` describes: depths, parents, paths, segments and chains, defined once.

Why this module exists: the row format stores the tree as one column, ``kv_end`` (one past the
last node of each node's subtree, depth-first pre-order; docs/design.md), and attention, the
recurrent mixers, the exactness guard and the row checks all need the tree back from it. Each
used to re-derive it its own way; this is the one definition, with a slow reference beside each
fast function (``tests/layout/test_geometry.py`` compares them on random trees). Numpy only.

A valid ``kv_end`` of length L holds ``p < kv_end[p] <= L`` and subtrees nest: a node's subtree
lies inside the subtree of every node that holds it. Packed documents and padding (a pad is
``kv_end[p] = p + 1``, a one-node tree) are simply more roots of the same forest. Worked example
(``SCATTERED`` of ``tests/strategies.py``: a has three children, d two)::

    p        0  1  2  3  4   5   6
    token    h  a  b  d  d2  d3  f          h
    kv_end   7  7  3  6  5   6   7          a
    depth    0  1  2  2  3   3   2        / | \\
    parent  -1  0  1  1  3   3   1       b  d  f
    segments [0, 3) [3, 5) [5, 6) [6, 7)       / \\
    chains   [0, 2) [2, 3) [3, 4) [4, 5)     d2  d3
             [5, 6) [6, 7)

Two ways of cutting a row into runs ``p, p+1, ...`` in which each node's parent is the node
before it, for two different consumers:

- a *segment* (attention, :mod:`onepass.attention.segments`) runs on through a node with several
  children into its first child (p - 1 is p's parent iff ``kv_end[p - 1] > p``) and ends only at
  a leaf. A segment's queries see its own keys causally and all ancestors of its first node, so
  one segment is one causal square plus one rectangle: the fewer, the better.
- a *chain* (recurrent mixers, :mod:`onepass.mixers.tree`) also ends at a node with two or more
  children. A scan hands on only its end state, and every child of a branching node must start
  from the state at that node, so a chain may only end there.

Every chain lies inside one segment; a segment is one or more consecutive chains (``[0, 3)`` is
the chains ``[0, 2)`` and ``[2, 3)`` above). Where no node branches, the two coincide.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike


def _as_kv_end(kv_end: ArrayLike) -> np.ndarray:
    return np.asarray(kv_end, dtype=np.int64)


def _flat(kv_end: np.ndarray) -> np.ndarray:
    """``[..., L]`` rows as one forest ``[T]``: each row's kv_end offset by its start (rows never mix)."""
    L = kv_end.shape[-1] if kv_end.ndim else 0
    rows = kv_end.reshape(-1, L)
    return (rows + (np.arange(len(rows)) * L)[:, None]).reshape(-1)


# --- validity ------------------------------------------------------------------------------------


def tree_breaks(kv_end: ArrayLike) -> np.ndarray:
    """Bool ``[L]``: positions where ``kv_end`` is not a subtree-end array (False everywhere iff it is one).

    p breaks the rule when ``kv_end[p]`` is outside ``(p, L]``, or when p is held by some subtree
    but not by one at the depth above it whose subtree contains p's. For a concatenation of rows in
    one array (each row offset, each in range) a flag lands inside the broken row. O(L log L).

    >>> tree_breaks([3, 4, 4, 4]).tolist()       # [0, 3) and [1, 4) overlap without nesting
    [False, True, False, True]
    """
    return _breaks_and_parents(_as_kv_end(kv_end))[0]


def _breaks_and_parents(kv_end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(:func:`tree_breaks`, :func:`parents`) of a ``[L]`` forest; the parents mean something only without breaks.

    Why it is enough: a node p of depth d > 0 needs a node a < p of depth d - 1 whose subtree holds
    p's; if every node has one, no two subtrees overlap without nesting (take a crossing pair
    k < p < kv_end[k] < kv_end[p] with p smallest: a cannot be k, nor later than k (a crossing
    pair ending before p), nor earlier (then every ancestor of a holds p, and k too: depth d + 1).
    """
    L = len(kv_end)
    pos = np.arange(L)
    out = (kv_end <= pos) | (kv_end > L)
    if out.any():
        return out, np.full(L, -1, dtype=np.int64)
    ends_at = np.bincount(kv_end, minlength=L + 1)[:L]  # subtrees that end just before p
    depth = pos - np.cumsum(ends_at)  # :func:`depths`
    first = _first_children(kv_end)
    up = _parents(kv_end, depth, first)  # in a tree, the parent; checked here
    # a first child's parent is p - 1: the same depth check is "no subtree ends at p" (no gathers)
    out[1:] = first[1:] & ((ends_at[1:] > 0) | (kv_end[1:] > kv_end[:-1]))
    rest = np.flatnonzero(~first & (depth > 0))
    a = np.maximum(up[rest], 0)
    out[rest] = (up[rest] < 0) | (depth[a] != depth[rest] - 1) | (kv_end[a] <= rest) | (kv_end[rest] > kv_end[a])
    return out, up


def is_tree(kv_end: ArrayLike) -> bool:
    """Whether ``kv_end`` ([L]) is a subtree-end array of a forest laid out depth-first."""
    return not tree_breaks(kv_end).any()


def is_tree_reference(kv_end: ArrayLike) -> bool:
    """The literal rule, O(L^2): every p in range, and every subtree holding p holds p's subtree."""
    kv_end = _as_kv_end(kv_end).tolist()
    L = len(kv_end)
    return all(p < kv_end[p] <= L for p in range(L)) and all(
        kv_end[p] <= kv_end[k] for p in range(L) for k in range(p) if kv_end[k] > p)


def check_tree(kv_end: ArrayLike) -> np.ndarray:
    """The :func:`parents` of ``kv_end`` ([L] or [B, L]); ValueError naming the first row and position
    unless every row is a tree."""
    kv_end = _as_kv_end(kv_end)
    rows = kv_end.reshape(-1, kv_end.shape[-1])
    B, L = rows.shape
    breaks, parent = _breaks_and_parents(_flat(rows))
    breaks |= rows.reshape(-1) > L
    if breaks.any():
        b, p = divmod(int(np.flatnonzero(breaks)[0]), L)
        raise ValueError(f"kv_end does not describe a tree: row {b}, position {p} (kv_end {rows[b, p]}) is not "
                         "inside the subtree of its parent")
    return np.maximum(parent.reshape(B, L) - (np.arange(B) * L)[:, None], -1).reshape(kv_end.shape)  # a root: -1


# --- depth, ancestors, parents -------------------------------------------------------------------


def depths(kv_end: ArrayLike) -> np.ndarray:
    """Depth of every node (``[L]`` or ``[B, L]``, like ``kv_end``): its number of proper ancestors.

    The ancestors of p are the earlier k whose subtree holds p, ``#{k < p : kv_end[k] > p}``, which
    is ``p - #{k : kv_end[k] <= p}`` (a subtree ends after its node): one count, O(L).

    >>> depths([7, 7, 3, 6, 5, 6, 7]).tolist()
    [0, 1, 2, 2, 3, 3, 2]
    """
    kv_end = _as_kv_end(kv_end)
    return _depths(_flat(kv_end)).reshape(kv_end.shape)


def _depths(flat: np.ndarray) -> np.ndarray:
    closed = np.cumsum(np.bincount(flat, minlength=len(flat) + 1))[:len(flat)]  # earlier rows: all closed
    return np.arange(len(flat)) - closed


def _row_starts(shape: tuple[int, ...]) -> np.ndarray:
    """Flat ``[T]``: the flat index of the start of each position's row."""
    L = shape[-1] if shape else 0
    return np.repeat(np.arange(0, int(np.prod(shape)), max(L, 1)), L)


def _last_at_depth(depth: np.ndarray, target: np.ndarray, at: np.ndarray, among: np.ndarray) -> np.ndarray:
    """For each position ``at``: the last node of ``among`` (ascending positions) at or before it whose
    depth is ``target``, -1 if none. One stable sort by depth and a binary search, O(n log n)."""
    if not len(among):
        return np.full(len(at), -1, dtype=np.int64)
    T = len(depth)
    order = among[np.argsort(depth[among], kind="stable")]  # by depth, then position
    i = np.searchsorted(depth[order] * T + order, target * T + at, side="right") - 1
    found = order[np.maximum(i, 0)]
    return np.where((i >= 0) & (depth[found] == target), found, -1)


def depths_reference(kv_end: ArrayLike) -> np.ndarray:
    """The literal rule, O(L^2) per row: how many earlier nodes' subtrees hold p."""
    kv_end = _as_kv_end(kv_end)
    rows = kv_end.reshape(-1, kv_end.shape[-1]).tolist()
    return np.array([[sum(1 for k in range(p) if row[k] > p) for p in range(len(row))] for row in rows],
                    dtype=np.int64).reshape(kv_end.shape)


def ancestor_at(kv_end: ArrayLike, depth: ArrayLike, *, node_depths: ArrayLike | None = None) -> np.ndarray:
    """For each node p, its ancestor (or itself) at ``depth[p]``; -1 where ``depth[p]`` is outside ``[0, depth of p]``.

    The ancestors of p appear in the row in order of depth, and the one at depth d is the last node
    of depth d at or before p (depth-first order): one stable sort by depth, O(L log L).
    ``kv_end`` and ``depth`` are ``[L]`` or ``[B, L]``; ``node_depths``: :func:`depths` of ``kv_end``
    when the caller has them already.

    >>> ancestor_at([7, 7, 3, 6, 5, 6, 7], [0, 0, 1, 1, 1, 2, 1]).tolist()
    [0, 0, 1, 1, 1, 3, 1]
    """
    kv_end = _as_kv_end(kv_end)
    own_BL = (depths(kv_end) if node_depths is None else np.asarray(node_depths)).reshape(-1, kv_end.shape[-1])
    target_BL = np.asarray(depth, dtype=np.int64).reshape(own_BL.shape)
    ok_BL = (target_BL >= 0) & (target_BL <= own_BL)
    nodes_L = np.arange(own_BL.shape[1])
    out_BL = np.empty_like(own_BL)
    for b in range(len(own_BL)):  # row by row: a small search is faster than one over the batch
        out_BL[b] = _last_at_depth(own_BL[b], np.where(ok_BL[b], target_BL[b], 0), nodes_L, nodes_L)
    return np.where(ok_BL, out_BL, -1).reshape(kv_end.shape)


def ancestor_at_reference(kv_end: ArrayLike, depth: ArrayLike) -> np.ndarray:
    """Slow reference of :func:`ancestor_at` ([L] only): walk up the parents from p."""
    parent = parents_reference(kv_end)
    own = depths_reference(kv_end)
    out = []
    for p, d in enumerate(np.asarray(depth, dtype=np.int64).tolist()):
        q = p
        if not 0 <= d <= own[p]:
            out.append(-1)
            continue
        for _ in range(own[p] - d):
            q = int(parent[q])
        out.append(q)
    return np.array(out, dtype=np.int64)


def parents(kv_end: ArrayLike) -> np.ndarray:
    """Parent of each node (``[L]`` or ``[B, L]``, row coordinates): the nearest earlier k with
    ``k < p < kv_end[k]``, -1 for a root (a padded position is one). O(L log L).

    >>> parents([7, 7, 3, 6, 5, 6, 7]).tolist()
    [-1, 0, 1, 1, 3, 3, 1]
    """
    kv_end = _as_kv_end(kv_end)
    flat = _flat(kv_end)
    parent = _parents(flat, _depths(flat))
    return np.where(parent >= 0, parent - _row_starts(kv_end.shape), -1).reshape(kv_end.shape)


def _first_children(flat: np.ndarray) -> np.ndarray:
    """Bool: p - 1's subtree holds p, so p - 1 is p's parent (in a tree)."""
    out = np.zeros(len(flat), dtype=bool)
    out[1:] = flat[:-1] > np.arange(1, len(flat))
    return out


def _parents(flat: np.ndarray, depth: np.ndarray, first: np.ndarray | None = None) -> np.ndarray:
    """Parents in a flat forest (flat indices): p - 1 for a first child (most nodes), else the last
    node one level up before p; -1 at depth 0."""
    first = _first_children(flat) if first is None else first
    out = np.arange(-1, len(flat) - 1)
    out[depth <= 0] = -1
    rest = np.flatnonzero(~first & (depth > 0))
    if len(rest):  # such a parent has a first child whose subtree ends before its own: few nodes
        branching = np.flatnonzero(first[1:] & (flat[1:] < flat[:-1]))
        out[rest] = _last_at_depth(depth, depth[rest] - 1, rest, branching)
    return out


def parents_reference(kv_end: ArrayLike) -> np.ndarray:
    """The literal rule, O(L^2) ([L] only): the nearest earlier position that ``p`` sees."""
    kv_end = _as_kv_end(kv_end)
    out = np.full(len(kv_end), -1, dtype=np.int64)
    for p in range(len(kv_end)):
        seen = np.flatnonzero((np.arange(len(kv_end)) < p) & (kv_end > p))
        if len(seen):
            out[p] = seen[-1]
    return out


def branches(kv_end: ArrayLike) -> bool:
    """Does some node have two or more children (a prefix shared by views)? Its first child p + 1 then
    ends its own subtree before the node's: ``p + 1 < kv_end[p]`` and ``kv_end[p + 1] < kv_end[p]``.
    Rows without (N-pass rows, one or several views each) are plain sequences side by side.

        >>> branches([7, 7, 3, 6, 5, 6, 7]), branches([3, 3, 3, 5, 5])    # SCATTERED; two chains
        (True, False)
    """
    flat = _flat(_as_kv_end(kv_end))
    p = np.arange(len(flat) - 1)
    return bool(np.any((flat[:-1] > p + 1) & (flat[1:] < flat[:-1])))


def branches_reference(kv_end: ArrayLike) -> bool:
    """The literal rule ([L] only): some parent (:func:`parents_reference`) occurs twice."""
    parent = parents_reference(kv_end)
    parent = parent[parent >= 0]
    return len(np.unique(parent)) < len(parent)


def is_leaf(kv_end: ArrayLike) -> np.ndarray:
    """Bool, like ``kv_end``: the nodes whose subtree is themselves (``kv_end[p] == p + 1``)."""
    kv_end = _as_kv_end(kv_end)
    return kv_end == np.arange(1, kv_end.shape[-1] + 1)


# --- paths ---------------------------------------------------------------------------------------


def root_path(kv_end: ArrayLike, q: int) -> np.ndarray:
    """The nodes q sees, root first and q last: its ancestors and itself (``k <= q < kv_end[k]``).

    >>> root_path([7, 7, 3, 6, 5, 6, 7], 5).tolist()
    [0, 1, 3, 5]
    """
    kv_end = _as_kv_end(kv_end)
    nodes = np.arange(len(kv_end))
    return nodes[(nodes <= q) & (kv_end > q)]


def leaf_paths(kv_end: ArrayLike) -> list[np.ndarray]:
    """The root-to-leaf path of every leaf, in row order: the N-pass sequences a tree row holds.

    >>> [p.tolist() for p in leaf_paths([5, 3, 3, 5, 5])]
    [[0, 1, 2], [0, 3, 4]]
    """
    kv_end = _as_kv_end(kv_end)
    parent = parents(kv_end).tolist()
    out: list[np.ndarray] = []
    for leaf in np.flatnonzero(is_leaf(kv_end)).tolist():
        path = [leaf]
        while parent[path[-1]] >= 0:
            path.append(parent[path[-1]])
        out.append(np.array(path[::-1], dtype=np.int64))
    return out


def leaf_paths_reference(kv_end: ArrayLike) -> list[np.ndarray]:
    """The literal rule: for every leaf q, the keys q sees."""
    kv_end = _as_kv_end(kv_end)
    return [root_path(kv_end, q) for q in range(len(kv_end)) if kv_end[q] == q + 1]


# --- segments (attention) ------------------------------------------------------------------------


def segment_starts(kv_end: ArrayLike) -> np.ndarray:
    """Bool, like ``kv_end``: p starts a segment (p = 0, or p - 1 is a leaf, so it is not p's parent)."""
    kv_end = _as_kv_end(kv_end)
    out = np.ones(kv_end.shape, dtype=bool)
    out[..., 1:] = kv_end[..., :-1] == np.arange(1, kv_end.shape[-1])
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class Segments:
    """The segments of ``[B, L]`` rows laid end to end (T = B * L flat positions; rows never mix) and the
    ancestors of each, which every query of the segment sees besides the segment's own earlier keys.

    start_S, stop_S   int64 [S]: segment i is the flat positions [start, stop)
    anc_ptr_S1        int64 [S + 1]: segment i's ancestors are anc_index[anc_ptr[i]:anc_ptr[i + 1]]
    anc_index         int64: flat positions, ascending (the root path of the segment's first node)

    >>> s = segments([7, 7, 3, 6, 5, 6, 7])          # SCATTERED
    >>> s.start_S.tolist(), [s.ancestors(i).tolist() for i in range(s.num_segments)]
    ([0, 3, 5, 6], [[], [0, 1], [0, 1, 3], [0, 1]])
    """

    row_length: int
    start_S: np.ndarray
    stop_S: np.ndarray
    anc_ptr_S1: np.ndarray
    anc_index: np.ndarray

    @property
    def num_segments(self) -> int:
        return len(self.start_S)

    @property
    def num_ancestors_S(self) -> np.ndarray:
        return np.diff(self.anc_ptr_S1)

    def ancestors(self, i: int) -> np.ndarray:
        return self.anc_index[self.anc_ptr_S1[i]:self.anc_ptr_S1[i + 1]]


def segments(kv_end: ArrayLike) -> Segments:
    """The :class:`Segments` of ``kv_end`` ([L] or [B, L]); ValueError unless every row is a tree.

    A segment's ancestors are those of the segment j holding the parent a of its first node, then j's
    nodes up to a (a segment is a path, and j comes before it): one concatenation per segment that
    has ancestors, O(L + sum of their ancestors).
    """
    kv_end = _as_kv_end(kv_end)
    rows = kv_end.reshape(-1, kv_end.shape[-1]) if kv_end.ndim else kv_end.reshape(1, 0)
    B, L = rows.shape
    T = B * L
    parent_T = check_tree(rows).reshape(-1)
    start_S = np.flatnonzero(segment_starts(_flat(rows)))
    stop_S = np.append(start_S[1:], T).astype(np.int64)
    up_S = parent_T[start_S]
    held = np.flatnonzero(up_S >= 0)
    up_S[held] += start_S[held] // L * L  # row coordinates to flat ones
    holder = np.searchsorted(start_S, up_S[held], "right") - 1
    ancestors: dict[int, np.ndarray] = {}
    empty = np.zeros(0, dtype=np.int64)
    for i, a, j in zip(held.tolist(), up_S[held].tolist(), holder.tolist()):
        ancestors[i] = np.concatenate([ancestors.get(j, empty), np.arange(start_S[j], a + 1)])
    num_S = np.zeros(len(start_S), dtype=np.int64)
    for i, anc in ancestors.items():
        num_S[i] = len(anc)
    anc_index = np.concatenate([ancestors[i] for i in sorted(ancestors)]) if ancestors else empty
    return Segments(row_length=L, start_S=start_S.astype(np.int64), stop_S=stop_S,
                    anc_ptr_S1=np.concatenate([[0], np.cumsum(num_S)]).astype(np.int64), anc_index=anc_index)


def segments_reference(kv_end: ArrayLike) -> list[tuple[int, int]]:
    """Slow reference: ``[start, stop)`` of each segment, joining p to p - 1's run when p - 1 is p's parent."""
    parent = parents_reference(kv_end)
    out: list[list[int]] = []
    for p, up in enumerate(parent.tolist()):
        if out and up == p - 1:
            out[-1][1] = p + 1
        else:
            out.append([p, p + 1])
    return [(s, e) for s, e in out]


def segment_ancestors_reference(kv_end: ArrayLike) -> list[np.ndarray]:
    """Slow reference ([L] only): each segment's ancestors are the root path of its first node, less the node."""
    return [root_path(kv_end, s)[:-1] for s, _ in segments_reference(kv_end)]


# --- chains (recurrent mixers) -------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Chain:
    start: int  # first row position
    end: int  # one past the last
    parent: int  # index of the chain it continues in the same row's tuple, -1 for a root
    depth: int  # number of ancestor chains


def _row_chains(parent: np.ndarray) -> tuple[Chain, ...]:
    n = len(parent)
    if not n:
        return ()
    children = np.bincount(parent[parent >= 0], minlength=n)
    idx = np.arange(1, n)
    cont = (parent[1:] == idx - 1) & (children[:-1] == 1)
    starts = np.concatenate([[0], idx[~cont]])
    ends = np.append(starts[1:], n)
    up = parent[starts]
    # a chain continues from the last node of another (in a depth-first row the first child of k is
    # k + 1, so a start whose parent is not the node before it hangs off a node with several children)
    up_chain = np.where(up >= 0, np.searchsorted(starts, up, side="right") - 1, -1)
    assert (ends[up_chain[up >= 0]] == up[up >= 0] + 1).all(), "a chain continues from the last node of another"
    out: list[Chain] = []
    for s, e, c in zip(starts.tolist(), ends.tolist(), up_chain.tolist()):
        out.append(Chain(start=s, end=e, parent=c, depth=out[c].depth + 1 if c >= 0 else 0))
    return tuple(out)


def row_chains(kv_end: ArrayLike) -> tuple[Chain, ...]:
    """The chains of one row, in row order (a chain's parent comes before it).

    >>> [(c.start, c.end, c.parent, c.depth) for c in row_chains([7, 7, 3, 6, 5, 6, 7])]
    [(0, 2, -1, 0), (2, 3, 0, 1), (3, 4, 0, 1), (4, 5, 2, 2), (5, 6, 2, 2), (6, 7, 0, 1)]
    """
    return _row_chains(parents(kv_end))


def batch_chains(kv_end_BL: ArrayLike) -> tuple[tuple[Chain, ...], ...]:
    """:func:`row_chains` of every row of a ``[B, L]`` batch (padding included)."""
    parent_BL = parents(np.asarray(kv_end_BL, dtype=np.int64).reshape(-1, np.shape(kv_end_BL)[-1]))
    return tuple(_row_chains(row) for row in parent_BL)


def chains_reference(kv_end: ArrayLike) -> tuple[Chain, ...]:
    """Slow reference: p joins the chain of p - 1 when p - 1 is p's parent and has no other child,
    found by walking every node's ancestors; depth is the number of chain starts above a node."""
    kv_end = _as_kv_end(kv_end)
    parent = parents_reference(kv_end)
    n = len(kv_end)

    def ancestors(p: int) -> list[int]:
        path = []
        while parent[p] >= 0:
            p = int(parent[p])
            path.append(p)
        return path

    num_children = [sum(1 for q in range(n) if parent[q] == p) for p in range(n)]
    starts = [p for p in range(n) if not (p > 0 and parent[p] == p - 1 and num_children[p - 1] == 1)]
    out: list[Chain] = []
    for i, s in enumerate(starts):
        e = starts[i + 1] if i + 1 < len(starts) else n
        above = ancestors(s)
        c = next((j for j, x in enumerate(out) if above and x.start <= above[0] < x.end), -1)
        out.append(Chain(start=s, end=e, parent=c, depth=sum(1 for a in above if a in starts)))
    return tuple(out)


def chain_paths(chains: Sequence[Chain]) -> list[list[int]]:
    """The root-to-chain sequence of chain indices for each chain (its own last)."""
    out: list[list[int]] = []
    for c in chains:
        out.append((out[c.parent] if c.parent >= 0 else []) + [len(out)])
    return out
