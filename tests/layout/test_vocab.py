"""A compacted vocabulary: one renumbering for views (verify, bench) and for rows (train), IGNORE kept."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import V

import onepass.layout.vocab
from onepass.layout.tree import IGNORE, build_layout
from onepass.layout.vocab import layout_ids, remap, remap_layout, used_ids

FAST = settings(max_examples=60, deadline=None)
big_views = st.lists(st.tuples(st.lists(st.sampled_from([3, 70, 151667, 9000, 12]), min_size=1, max_size=8),
                               st.integers(0, 8)), min_size=1, max_size=4).map(
    lambda specs: [V(t, min(k, len(t))) for t, k in specs])


def test_docstring_example():
    result = doctest.testmod(onepass.layout.vocab)
    assert result.attempted >= 2 and result.failed == 0


@FAST
@given(big_views)
def test_compacting_commutes_with_the_layout(views):
    """Compact the views then lay them out (verify) == lay out then compact the row (train)."""
    from onepass.verify.check import compact_vocab

    compacted, vocab = compact_vocab([views])
    row = build_layout(views)
    used = used_ids(layout_ids([row]))
    assert vocab == len(used)
    expected = remap_layout(row, used)
    got = build_layout(compacted[0])
    for name in ("input_ids", "position_ids", "kv_end", "targets", "weights"):
        assert np.array_equal(getattr(got, name), getattr(expected, name)), name
    assert set(np.unique(got.input_ids)) == set(range(vocab))  # dense 0..V-1
    assert np.array_equal(used[got.input_ids], row.input_ids)  # used maps back to the original ids
    trained = row.targets != IGNORE
    assert np.array_equal(got.targets == IGNORE, ~trained)
    assert np.array_equal(used[got.targets[trained]], row.targets[trained])


def test_the_train_data_compaction_uses_one_map_for_train_and_eval():
    from onepass.train.run.data import TrainData, compact_vocab

    train = TrainData(units=[[build_layout([V([5, 9, 7], 1)])]], kind="row", source="a", stats={})
    evals = TrainData(units=[[build_layout([V([9, 11], 1)])]], kind="row", source="b", stats={})
    (t, e), used = compact_vocab(train, evals)
    assert used.tolist() == [5, 7, 9, 11]
    assert t.units[0][0].input_ids.tolist() == [0, 2, 1] and e.units[0][0].input_ids.tolist() == [2, 3]
    assert t.units[0][0].targets.tolist() == [2, 1, IGNORE]


def test_an_id_outside_the_map_is_refused():
    with pytest.raises(AssertionError, match="outside the compacted vocabulary"):
        remap(np.array([4]), np.array([3, 5]))
