"""The tree read from kv_end (onepass.layout.geometry): every fast function equals its slow reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onepass.layout.geometry import (ancestor_at, ancestor_at_reference, batch_chains, branches, branches_reference,
                                     chains_reference, check_tree, depths, depths_reference, is_tree,
                                     is_tree_reference, leaf_paths, leaf_paths_reference, parents, parents_reference,
                                     row_chains, segment_ancestors_reference, segment_starts, segments,
                                     segments_reference, tree_breaks)
from strategies import DOC_EXAMPLE, SCATTERED, batch_strategy, layout_st


def test_the_docstring_tree_by_eye():
    assert depths(SCATTERED).tolist() == [0, 1, 2, 2, 3, 3, 2]
    assert parents(SCATTERED).tolist() == [-1, 0, 1, 1, 3, 3, 1]
    assert np.flatnonzero(segment_starts(SCATTERED)).tolist() == [0, 3, 5, 6]
    assert segments_reference(SCATTERED) == [(0, 3), (3, 5), (5, 6), (6, 7)]
    assert [p.tolist() for p in leaf_paths(SCATTERED)] == [[0, 1, 2], [0, 1, 3, 4], [0, 1, 3, 5], [0, 1, 6]]
    assert segments_reference(DOC_EXAMPLE) == [(0, 4), (4, 8)]
    segs = segments(SCATTERED)
    assert [segs.ancestors(i).tolist() for i in range(segs.num_segments)] == [[], [0, 1], [0, 1, 3], [0, 1]]
    assert branches(SCATTERED) and not branches([3, 3, 3, 5, 5, 6])  # two views and a pad side by side


@settings(max_examples=150, deadline=None)
@given(batch_strategy(max_extra_pad=4))
def test_depths_parents_and_ancestors_equal_the_reference(kv_end_BL):
    assert depths(kv_end_BL).tolist() == depths_reference(kv_end_BL).tolist()
    parent_BL = parents(kv_end_BL)  # the batch at once equals row by row
    assert check_tree(kv_end_BL).tolist() == parent_BL.tolist()
    rng = np.random.default_rng(0)
    chains_B = batch_chains(kv_end_BL)
    for b, (kv_end, parent) in enumerate(zip(kv_end_BL, parent_BL, strict=True)):
        assert is_tree(kv_end)
        assert parent.tolist() == parents(kv_end).tolist() == parents_reference(kv_end).tolist()
        target = rng.integers(-1, 6, size=len(kv_end))
        assert ancestor_at(kv_end, target).tolist() == ancestor_at_reference(kv_end, target).tolist()
        assert [p.tolist() for p in leaf_paths(kv_end)] == [p.tolist() for p in leaf_paths_reference(kv_end)]
        starts = np.flatnonzero(segment_starts(kv_end)).tolist()
        assert starts == [s for s, _ in segments_reference(kv_end)]
        segs = segments(kv_end)
        assert list(zip(segs.start_S.tolist(), segs.stop_S.tolist())) == segments_reference(kv_end)
        assert [segs.ancestors(i).tolist() for i in range(segs.num_segments)] == [
            a.tolist() for a in segment_ancestors_reference(kv_end)]
        assert chains_B[b] == row_chains(kv_end) == chains_reference(kv_end)
        assert branches(kv_end) == branches_reference(kv_end)
    assert branches(kv_end_BL) == any(branches_reference(kv_end) for kv_end in kv_end_BL)
    B, L = kv_end_BL.shape  # the batch's segments are its rows' laid end to end, in flat positions
    flat = segments(kv_end_BL)
    per_row = [segments(kv_end) for kv_end in kv_end_BL]
    assert flat.start_S.tolist() == [b * L + s for b, r in enumerate(per_row) for s in r.start_S.tolist()]
    assert flat.anc_index.tolist() == [b * L + a for b, r in enumerate(per_row) for a in r.anc_index.tolist()]


def arbitrary_kv_end():
    """Arrays with every kv_end[p] in (p, L]: mostly not trees (subtrees that overlap)."""
    return st.integers(1, 12).flatmap(lambda L: st.tuples(*[st.integers(p + 1, L) for p in range(L)])).map(list)


@settings(max_examples=400, deadline=None)
@given(st.one_of(arbitrary_kv_end(), layout_st.map(lambda row: row.kv_end.tolist())))
def test_is_tree_equals_the_literal_rule(kv_end):
    assert is_tree(kv_end) == is_tree_reference(kv_end)


@settings(max_examples=100, deadline=None)
@given(st.lists(arbitrary_kv_end(), min_size=2, max_size=4))
def test_a_break_is_flagged_inside_the_row_that_breaks(rows):
    # rows concatenated into one array (each offset by its start), as the row check reads them
    offsets = np.cumsum([0] + [len(r) for r in rows])
    flat = np.concatenate([np.asarray(r) + o for r, o in zip(rows, offsets)])
    flagged = {int(np.searchsorted(offsets, p, side="right") - 1) for p in np.flatnonzero(tree_breaks(flat))}
    assert flagged == {i for i, r in enumerate(rows) if not is_tree_reference(r)}


def test_check_tree_names_the_row_and_refuses_out_of_range():
    check_tree([SCATTERED, [7, 2, 7, 4, 7, 7, 7]])
    with pytest.raises(ValueError, match="not describe a tree: row 1, position 1"):
        check_tree([[4, 2, 3, 4], [3, 4, 4, 4]])
    with pytest.raises(ValueError, match="not describe a tree"):
        check_tree([2, 1])
