"""A row's tree as chains: the runs a recurrent layer can scan in one go.

Why this module exists: a recurrent layer (a short convolution, Mamba2, Gated
DeltaNet) must see, at node p, only p's ancestors in order. Attention gets that
from the mask; a scan needs the tree cut into *chains*: maximal runs
``p, p+1, ...`` in which each node's parent is the node before it and that node
has no other child. A chain starts from the end state of the chain it continues
(the parent of its first node is always the last node of another chain: in a
depth-first row the first child of k is k + 1, so a node whose parent is not the
node before it hangs off a node with two or more children).

    h a b | d d2 | d3 | f      kv_end [7, 7, 3, 6, 5, 6, 7]   (tests/strategies SCATTERED)
    parents  [-1, 0, 1, 1, 3, 3, 1]
    chains   [0, 2) root; [2, 3), [3, 4) and [6, 7) from node 1 (a has three children);
             [4, 5) and [5, 6) from node 3 (d has two)

A padded position (``kv_end[p] == p + 1`` and no parent) is its own root chain.
Pure layout: numpy only. :func:`chains_reference` walks every node's ancestors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike


@dataclass(frozen=True, kw_only=True, slots=True)
class Chain:
    start: int  # first row position
    end: int  # one past the last
    parent: int  # index of the chain it continues in the same row's tuple, -1 for a root
    depth: int  # number of ancestor chains


def parents(kv_end: ArrayLike) -> np.ndarray:
    """Parent of each position: the nearest earlier k with ``k < p < kv_end[k]`` (-1: a root).

    Subtrees nest in a depth-first row, so one stack pass finds them.

    >>> parents([7, 7, 3, 6, 5, 6, 7]).tolist()
    [-1, 0, 1, 1, 3, 3, 1]
    """
    kv_end = np.asarray(kv_end, dtype=np.int64)
    out, stack = np.full(len(kv_end), -1, dtype=np.int64), []
    for p in range(len(kv_end)):
        while stack and kv_end[stack[-1]] <= p:
            stack.pop()
        if stack:
            out[p] = stack[-1]
        stack.append(p)
    return out


def parents_reference(kv_end: ArrayLike) -> np.ndarray:
    """The literal rule, O(L^2): the nearest earlier position that ``p`` sees."""
    kv_end = np.asarray(kv_end, dtype=np.int64)
    out = np.full(len(kv_end), -1, dtype=np.int64)
    for p in range(len(kv_end)):
        seen = np.flatnonzero((np.arange(len(kv_end)) < p) & (kv_end > p))
        if len(seen):
            out[p] = seen[-1]
    return out


def row_chains(kv_end: ArrayLike) -> tuple[Chain, ...]:
    """The chains of one row, in row order (a chain's parent comes before it).

    >>> [(c.start, c.end, c.parent, c.depth) for c in row_chains([7, 7, 3, 6, 5, 6, 7])]
    [(0, 2, -1, 0), (2, 3, 0, 1), (3, 4, 0, 1), (4, 5, 2, 2), (5, 6, 2, 2), (6, 7, 0, 1)]
    """
    parent = parents(kv_end)
    n = len(parent)
    children = np.bincount(parent[parent >= 0], minlength=n)
    idx = np.arange(1, n)
    cont = (parent[1:] == idx - 1) & (children[:-1] == 1)
    starts = np.concatenate([[0], idx[~cont]]) if n else np.zeros(0, dtype=np.int64)
    ends = np.append(starts[1:], n)
    chain_of_end: dict[int, int] = {}  # last node -> its chain
    out: list[Chain] = []
    for i, (s, e) in enumerate(zip(starts.tolist(), ends.tolist())):
        up = int(parent[s])
        c = chain_of_end[up] if up >= 0 else -1
        assert up < 0 or out[c].end == up + 1, "a chain continues from the last node of another"
        out.append(Chain(start=s, end=e, parent=c, depth=out[c].depth + 1 if c >= 0 else 0))
        chain_of_end[e - 1] = i
    return tuple(out)


def batch_chains(kv_end_BL: ArrayLike) -> tuple[tuple[Chain, ...], ...]:
    """:func:`row_chains` of every row of a ``[B, L]`` batch (padding included)."""
    return tuple(row_chains(row) for row in np.asarray(kv_end_BL, dtype=np.int64))


def chains_reference(kv_end: ArrayLike) -> tuple[Chain, ...]:
    """Slow reference: p joins the chain of p - 1 when p - 1 is p's parent and has no other child,
    found by walking every node's ancestors; depth is the number of chain starts above a node."""
    kv_end = np.asarray(kv_end, dtype=np.int64)
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
