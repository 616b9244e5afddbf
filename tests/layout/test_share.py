"""Trees of different conversations merged where they share a prefix (onepass.layout.share): the invariants.

Every test here fails on the code before sharing existed (there was no ``onepass.layout.share`` and no
``PrefixTree.insert_layout``); the properties are the ones docs/design.md promises: each view's
trained tokens see exactly the view's own tokens before them (no leakage between conversations),
the loss terms and weights are the per-conversation ones, rows respect ``max_tokens``, a group
larger than a row is split into rows that each hold the shared prefix once, sharing stays inside
its window and never merges two trees of one conversation.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onepass.layout.geometry import is_tree, root_path
from onepass.layout.pack import pack_layouts
from onepass.layout.row_check import check_rows
from onepass.layout.schedule import parse_schedule, schedule_views, view_weights
from onepass.layout.share import (
    SHARE_MIN,
    loss_terms,
    loss_terms_reference,
    merge_layouts,
    prefix_key,
    same_terms,
    share_and_pack,
    window_order,
)
from onepass.layout.tree import IGNORE, PrefixTree, build_layout
from onepass.layout.view import View

PREFIX = list(range(1000, 1000 + SHARE_MIN + 6))  # a "system prompt" every conversation of a harness begins with


def V(tokens, num_prompt, turn=0):
    return View(tokens=np.asarray(tokens, dtype=np.int64), num_prompt=num_prompt, turn=turn)


def conversation(prefix, turns):
    """Views of a chat after ``prefix``: turn k's prompt is the history, its completion ``r + a`` (reasoning
    ``r`` dropped from later prompts, as Qwen3 does)."""
    views, history = [], list(prefix)
    for user, reasoning, answer in turns:
        history = history + user
        views.append(V(history + reasoning + answer, len(history), turn=len(views)))
        history = history + answer
    return views


# tokens 0-3: lots of identical turns across conversations, so shared nodes, duplicated nodes (two targets)
# and trained nodes inside the shared part all occur
segment = st.lists(st.integers(0, 3), min_size=1, max_size=4)
turns_st = st.lists(st.tuples(segment, st.lists(st.integers(0, 3), max_size=3), segment), min_size=1, max_size=3)
conversations_st = st.lists(st.tuples(st.integers(0, 2), turns_st), min_size=1, max_size=6)


def harness_prefix(h):
    return PREFIX if h == 0 else PREFIX[:SHARE_MIN - 1 + h] + [7 + h] * 3  # 0 and 1, 2 share 64+ tokens


def view_terms(convs, weighting):
    """The loss terms the views hold, straight from the views: (context tokens, target) -> weight."""
    out = {}
    for views in convs:
        for v, w in zip(views, view_weights(views, weighting)):
            for j in range(max(v.num_prompt, 1), len(v)):
                key = (tuple(v.tokens[:j].tolist()), int(v.tokens[j]))
                out[key] = out.get(key, 0.0) + w
    return out


def trees_of(convs, schedule="one-pass", weighting="token"):
    trees, units = [], []
    for c, views in enumerate(convs):
        out = schedule_views(views, parse_schedule(schedule), weighting=weighting)
        trees += out.layouts
        units += [c] * len(out.layouts)
    return trees, units


@settings(max_examples=150, deadline=None)
@given(conversations_st, st.sampled_from(["token", "turn", "conversation"]), st.integers(0, 60),
       st.sampled_from(["one-pass", "k-pass:2"]))
def test_each_view_sees_exactly_its_own_tokens_and_keeps_its_loss_terms(specs, weighting, slack, schedule):
    convs = [conversation(harness_prefix(h), turns) for h, turns in specs]
    trees, units = trees_of(convs, schedule, weighting)
    max_tokens = max(map(len, trees)) + slack
    shared = share_and_pack(trees, units, max_tokens)
    check_rows(shared.rows)
    assert all(len(r) <= max_tokens and is_tree(r.kv_end) for r in shared.rows)
    # the terms: (context, target) -> weight, read off the rows, are the views' own (per-view weights kept)
    want = view_terms(convs, weighting)
    assert same_terms(loss_terms_reference(shared.rows), want)
    assert same_terms(loss_terms_reference(pack_layouts(trees, max_tokens)), want)
    assert same_terms(loss_terms(shared.rows), loss_terms(pack_layouts(trees, max_tokens)))
    # every position of every tree went to a node of the same context (tokens from the root) and target
    for tree, (r, positions) in zip(trees, shared.where):
        row = shared.rows[r]
        for p in range(len(tree)):
            q = int(positions[p])
            assert row.input_ids[root_path(row.kv_end, q)].tolist() == tree.input_ids[root_path(tree.kv_end, p)].tolist()
            assert tree.targets[p] == IGNORE or row.targets[q] == tree.targets[p]
    assert shared.num_tokens <= sum(map(len, trees))


def test_a_shared_prefix_is_computed_once_and_trains_nothing():
    a = conversation(PREFIX, [([1, 2], [3], [4, 5])])
    b = conversation(PREFIX, [([6], [], [7])])
    trees, units = trees_of([a, b])
    shared = share_and_pack(trees, units, 10_000)
    (row,) = shared.rows
    assert len(row) == sum(map(len, trees)) - len(PREFIX)  # the prefix once
    assert row.input_ids[:len(PREFIX)].tolist() == PREFIX and (row.targets[:len(PREFIX) - 1] == IGNORE).all()
    # b's branch hangs off the last prefix token: it sees the prefix, not a's tokens
    b_first = len(PREFIX) + len(trees[0]) - len(PREFIX)
    assert row.input_ids[b_first] == 6
    assert row.input_ids[root_path(row.kv_end, b_first)].tolist() == PREFIX + [6]


def test_a_group_larger_than_a_row_is_split_into_rows_that_each_hold_the_prefix_once():
    convs = [conversation(PREFIX, [([10 + c], [20 + c], [30 + c, 31])]) for c in range(7)]
    trees, units = trees_of(convs)
    own = len(trees[0]) - len(PREFIX)  # 5 tokens after the prefix, the same for each
    max_tokens = len(PREFIX) + 3 * own  # three conversations fit a row
    shared = share_and_pack(trees, units, max_tokens)
    assert sorted(len(g) for g in shared.groups) == [1, 3, 3]  # 7 = 3 + 3 + 1
    for row in shared.rows:
        roots = np.flatnonzero(row.position_ids == 0)
        prefixes = [p for p in roots.tolist() if row.input_ids[p:p + len(PREFIX)].tolist() == PREFIX]
        assert len(prefixes) == len(roots)  # each tree in the row holds the prefix once
    assert shared.num_tokens == 3 * len(PREFIX) + 7 * own
    assert same_terms(loss_terms(shared.rows), loss_terms(trees))


def test_trees_of_one_conversation_are_never_merged():
    convs = [conversation(PREFIX, [([1], [2], [3]), ([4], [5], [6]), ([7], [8], [9])]) for _ in range(2)]
    trees, units = trees_of(convs, "k-pass:3")  # three trees each, all beginning with PREFIX
    shared = share_and_pack(trees, units, 10_000)
    for group in shared.groups:
        assert len({units[i] for i in group}) == len(group)
    assert len(shared.groups) == 3 and all(len(g) == 2 for g in shared.groups)


def test_sharing_stays_inside_its_window():
    convs = [conversation(PREFIX, [([c], [c], [c])]) for c in range(6)]
    trees, units = trees_of(convs)
    for window, expected in ((None, [6]), (2, [2, 2, 2]), (4, [4, 2]), (1, [1] * 6)):
        shared = share_and_pack(trees, units, 10_000, window=window)
        assert [len(g) for g in shared.groups] == expected, window
        for group in shared.groups:
            assert len({units[i] // (window or 6) for i in group}) == 1


def test_window_order_sorts_each_window_by_prefix_and_keeps_windows_in_order():
    keys = [(2,), None, (1,), (2,), (1,), (0,)]
    units = [0, 1, 2, 3, 4, 5]
    assert window_order(keys, units, None) == [5, 2, 4, 0, 3, 1]
    assert window_order(keys, units, 3) == [2, 0, 1, 5, 4, 3]  # windows {0,1,2} then {3,4,5}
    assert window_order(keys, [0, 0, 1, 1, 2, 2], 2) == [2, 0, 3, 1, 5, 4]  # windows count conversations


def test_trees_without_a_long_enough_common_prefix_keep_todays_rows():
    short = [conversation([5, 6, 7], [([c], [c + 1], [c + 2])]) for c in range(5)]  # share 3 tokens only
    trees, units = trees_of(short)
    assert prefix_key(trees[0]) is None
    shared = share_and_pack(trees, units, 40)
    today = pack_layouts(trees, 40)
    assert len(shared.rows) == len(today)
    for a, b in zip(shared.rows, today):
        for c in ("input_ids", "position_ids", "kv_end", "targets", "weights"):
            np.testing.assert_array_equal(getattr(a, c), getattr(b, c))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=10), st.integers(0, 10)), min_size=1,
                max_size=5), st.integers(1, 4))
def test_merging_laid_out_trees_equals_inserting_their_views(specs, split):
    views = [V(t, min(k, len(t))) for t, k in specs]
    merged = merge_layouts([build_layout(views[:split]), build_layout(views[split:])] if split < len(views)
                           else [build_layout(views)])
    assert same_terms(loss_terms_reference([merged]), loss_terms_reference([build_layout(views)]))
    assert len(merged) <= sum(map(len, views)) and is_tree(merged.kv_end)
    tree = PrefixTree()  # a tree merged into an empty one is laid out as it was
    tree.insert_layout(build_layout(views))
    alone = tree.layout()
    np.testing.assert_array_equal(alone.input_ids, build_layout(views).input_ids)
    np.testing.assert_array_equal(alone.kv_end, build_layout(views).kv_end)


def test_prefix_key_tells_prefix_lengths_apart():
    def tree(tokens):
        return build_layout([V(tokens, len(tokens) - 1)])

    base = list(range(300))
    k = prefix_key(tree(base))
    assert prefix_key(tree(base[:100] + [9999] * 200))[:1] == k[:1]  # first 64 agree
    assert prefix_key(tree(base[:100] + [9999] * 200))[1] != k[1]  # first 128 do not
    assert prefix_key(tree(base[:200] + [9999] * 100))[:2] == k[:2]
    assert prefix_key(tree(base[:SHARE_MIN - 1])) is None
