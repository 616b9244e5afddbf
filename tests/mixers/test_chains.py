"""The chain decomposition: equal to its slow reference, and scanning chain by chain from the parent
chain's end state equals scanning each node's ancestor path (the invariant a recurrent layer needs)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings

from onepass.layout.geometry import batch_chains, chain_paths, chains_reference, parents, parents_reference, row_chains

from strategies import SCATTERED, batch_strategy

KERNEL = np.array([0.5, -1.0, 2.0])  # a causal conv of width 3, then a decaying sum: conv + recurrent state


def scan(x, conv=None, h=0.0):
    """A toy mixer: causal conv (state: the last 2 inputs) then h = 0.9 h + y; returns outputs and end states."""
    conv = np.zeros(0) if conv is None else conv
    full = np.concatenate([np.zeros(2), conv, x])[-(len(x) + 2):]
    out = []
    for t in range(len(x)):
        h = 0.9 * h + float(full[t:t + 3] @ KERNEL) ** 2
        out.append(h)
    return np.array(out), np.concatenate([conv, x])[-2:], h


def chainwise(x, chains):
    out, ends = np.zeros(len(x)), []
    for c in chains:
        conv, h = ends[c.parent] if c.parent >= 0 else (None, 0.0)
        y, conv, h = scan(x[c.start:c.end], conv, h)
        out[c.start:c.end] = y
        ends.append((conv, h))
    return out


def by_paths(x, kv_end):
    parent = parents_reference(kv_end)
    out = np.zeros(len(x))
    for p in range(len(x)):
        path = [p]
        while parent[path[-1]] >= 0:
            path.append(parent[path[-1]])
        out[p] = scan(x[path[::-1]])[0][-1]
    return out


def test_the_docstring_tree_by_eye():
    assert parents(SCATTERED).tolist() == [-1, 0, 1, 1, 3, 3, 1]
    assert [(c.start, c.end, c.parent) for c in row_chains(SCATTERED)] == [
        (0, 2, -1), (2, 3, 0), (3, 4, 0), (4, 5, 2), (5, 6, 2), (6, 7, 0)]
    assert chain_paths(row_chains(SCATTERED))[4] == [0, 2, 4]


@settings(max_examples=150, deadline=None)
@given(batch_strategy(max_extra_pad=4))
def test_chains_equal_the_reference_and_scanning_them_equals_every_path(kv_end_BL):
    rng = np.random.default_rng(0)
    for kv_end, chains in zip(kv_end_BL, batch_chains(kv_end_BL), strict=True):
        assert parents(kv_end).tolist() == parents_reference(kv_end).tolist()
        assert chains == chains_reference(kv_end)
        assert [c.start for c in chains] == sorted(c.start for c in chains) and chains[-1].end == len(kv_end)
        x = rng.normal(size=len(kv_end))
        np.testing.assert_allclose(chainwise(x, chains), by_paths(x, kv_end), rtol=1e-12)


def test_scanning_the_row_as_one_sequence_differs():
    """The invariant can fail: a branching row scanned left to right is not its paths."""
    x = np.random.default_rng(1).normal(size=len(SCATTERED))
    whole = scan(x)[0]
    assert np.abs(whole - by_paths(x, np.array(SCATTERED))).max() > 1e-3
