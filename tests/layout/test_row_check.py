"""onepass.layout.row_check: the vectorised check of prepared rows agrees with the one-row reference, accepts every
row prepare builds (trees, packed rows) and names the row and column of each broken invariant."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import layout_st, views_st

from onepass.layout.row_check import RowError, check_rows, row_problem
from onepass.layout.tree import Layout, build_layout, concat, row_from_columns

SIX = row_from_columns({"input_ids": [1, 2, 3, 4, 5, 6], "position_ids": [0, 1, 2, 3, 2, 3],
                        "kv_end": [6, 6, 4, 4, 6, 6], "targets": [-100, 3, 4, -100, 6, -100],
                        "weights": [0, 1, 1, 0, 0.5, 0]})


def _with(row: Layout, **columns) -> Layout:
    return dataclasses.replace(row, **{c: np.asarray(v, dtype=getattr(row, c).dtype) for c, v in columns.items()})


@given(st.lists(views_st, min_size=1, max_size=4))
@settings(max_examples=60, deadline=None)
def test_rows_prepare_builds_pass(trees):
    layouts = [build_layout(v) for v in trees]
    rows = layouts + [concat(layouts)]
    if any(r.weights.sum() > 0 for r in rows):
        check_rows(rows, vocab_size=4)
        assert all(row_problem(r, 4) is None for r in rows)


@given(layout_st, st.integers(0, 10**6), st.sampled_from(["position_ids", "kv_end", "weights", "targets",
                                                          "input_ids"]), st.integers(-3, 14))
@settings(max_examples=300, deadline=None)
def test_fast_check_agrees_with_the_reference(layout, where, column, value):
    """One entry changed at random: the fast check refuses exactly the rows the reference refuses."""
    values = getattr(layout, column).copy()
    values[where % len(values)] = value
    bad = _with(layout, **{column: values})
    good = SIX
    problem = row_problem(bad, 8)
    if problem is None:
        check_rows([good, bad], vocab_size=8)
    else:
        with pytest.raises(RowError, match=r"row 1, " + problem.split(":")[0]):
            check_rows([good, bad], vocab_size=8)


@pytest.mark.parametrize(("change", "column"), [
    ({"kv_end": [6, 6, 6, 4, 6, 6]}, "kv_end"),        # q=2 sees into its sibling's subtree: views see each other
    ({"kv_end": [6, 6, 4, 4, 6, 0]}, "kv_end"),
    ({"kv_end": [6, 6, 4, 4, 6, 10**9]}, "kv_end"),
    ({"kv_end": [6, 6, 3, 4, 6, 6]}, "kv_end"),        # too short: 3 no longer sees 2
    ({"position_ids": [0, 1, 2, 3, 2, 10**7]}, "position_ids"),
    ({"position_ids": [0, 1, 2, -1, 2, 3]}, "position_ids"),
    ({"input_ids": [1, 2, 3, 4, 5, 99]}, "input_ids"),
    ({"input_ids": [1, 2, -3, 4, 5, 6]}, "input_ids"),
    ({"targets": [-100, 3, 4, -100, 60, -100]}, "targets"),
    ({"weights": [0, 1, np.nan, 0, 0.5, 0]}, "weights"),
    ({"weights": [0, 1, np.inf, 0, 0.5, 0]}, "weights"),
    ({"weights": [0, 1, -1, 0, 0.5, 0]}, "weights"),
    ({"weights": [0, 1, 1, 2, 0.5, 0]}, "weights"),     # weight on an ignored target
    ({"targets": [-100, 3, 4]}, "lengths"),
])
def test_each_broken_invariant_names_row_and_column(change, column):
    bad = _with(SIX, **change)
    with pytest.raises(RowError, match=rf"^data: row 2, {column}: "):
        check_rows([SIX, SIX, bad], vocab_size=8, source="data")


def test_all_zero_weights_are_refused_and_chunks_do_not_change_the_answer():
    zero = _with(SIX, weights=[0] * 6)
    with pytest.raises(RowError, match="no row has a positive weight"):
        check_rows([zero, zero])
    rows = [SIX] * 50 + [_with(SIX, kv_end=[6, 6, 6, 4, 6, 6])] + [SIX] * 10
    for chunk in (1, 7, 100, 1 << 20):
        with pytest.raises(RowError, match="row 50, kv_end"):
            check_rows(rows, chunk_tokens=chunk)
    check_rows([SIX] * 61, chunk_tokens=7)
