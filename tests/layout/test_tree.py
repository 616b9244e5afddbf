"""Prefix tree, layout, schedules and packing on small hand-checkable inputs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onepass.layout.pack import best_fit_decreasing, best_fit_reference, pack_layouts
from onepass.layout.schedule import contiguous_groups, parse_schedule, schedule_views, view_weights
from onepass.layout.tree import (COLUMNS, IGNORE, PrefixTree, ancestors_reference, build_layout, concat,
                          view_targets)
from onepass.layout.view import View


def V(tokens, num_prompt, turn=0):
    return View(tokens=np.asarray(tokens, dtype=np.int64), num_prompt=num_prompt, turn=turn)


def test_docstring_example_two_views_share_h():
    # A = [h a1 a2] trains a1 a2; B = [h b1] trains b1. h=1 a1=2 a2=3 b1=4.
    layout = build_layout([V([1, 2, 3], 1), V([1, 4], 1)])
    # node h needs target a1 (A) and b1 (B): different targets, so B gets its own copy of h
    assert layout.input_ids.tolist() == [1, 2, 3, 1, 4]
    assert layout.targets.tolist() == [2, 3, IGNORE, 4, IGNORE]
    assert layout.position_ids.tolist() == [0, 1, 2, 0, 1]
    assert layout.kv_end.tolist() == [3, 3, 3, 5, 5]


def test_paper_shape_layout():
    # view 1: [h1 | t1 r1]   view 2: [h1 r1' h2 | t2 r2]   (r1' = history form of the answer)
    h1, t1, r1, r1h, h2, t2, r2 = [10, 11], [20], [30, 31], [30, 31], [12], [21], [32]
    v1 = V(h1 + t1 + r1, 2)
    v2 = V(h1 + r1h + h2 + t2 + r2, 5)
    layout = build_layout([v1, v2])
    # h1 shared; then the heavier branch r1' h2 t2 r2 (5 nodes) before t1 r1 (3 nodes)
    assert layout.input_ids.tolist() == [10, 11, 30, 31, 12, 21, 32, 20, 30, 31]
    assert layout.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 2, 3, 4]
    # the first completion token t1 is predicted from the last prompt token (not from a copy)
    assert layout.targets.tolist() == [IGNORE, 20, IGNORE, IGNORE, 21, 32, IGNORE, 30, 31, IGNORE]
    assert layout.kv_end.tolist() == [10, 10, 7, 7, 7, 7, 7, 10, 10, 10]


def test_heaviest_child_first_keeps_the_history_one_range():
    # three turns: view k = [history_k | completion_k]; the history of turn k + 1 holds turn k's answer
    # without its reasoning, so each completion branches off the shared history
    h, a1, a2 = [1, 2], [5, 6], [7, 8]
    views = [V(h + [3, 4] + a1, 2), V(h + a1 + [9] + [3, 4] + a2, 5), V(h + a1 + [9] + a2 + [10, 3, 11], 8)]
    layout = build_layout(views)
    L = len(layout)
    # the history (every view's prompt) comes first as one chain; a branch sees a prefix of the row and
    # its own earlier nodes: two ranges
    for p in range(L):
        ancestors = [k for k in range(p) if p < layout.kv_end[k]]
        gaps = sum(b != a + 1 for a, b in zip(ancestors, ancestors[1:] + [p]))
        assert ancestors[:1] in ([], [0]) and gaps <= 1, (p, ancestors)
    # ties keep insertion order: [1 | 2] and [1 | 3] branch the same size
    assert build_layout([V([1, 2], 1), V([1, 3], 1)]).input_ids.tolist() == [1, 2, 1, 3]


def test_first_response_token_predicted_from_last_reasoning_token():
    # completion = <think> r </think> a ; the response token a is predicted at </think>
    think, r, end_think, a = 100, 101, 102, 103
    layout = build_layout([V([1, 2, think, r, end_think, a], 2)])
    p = int(np.flatnonzero(layout.targets == a)[0])
    assert layout.input_ids[p] == end_think


def test_empty_reasoning_turn_is_trained():
    # Qwen3 renders an empty <think>\n\n</think>\n\n block; the turn's tokens are still targets
    v1 = V([1, 2, 100, 102, 7], 2)  # no reasoning tokens between <think> and </think>
    v2 = V([1, 2, 7, 3, 100, 101, 102, 8], 4)
    layout = build_layout([v1, v2])
    trained = sorted(layout.targets[layout.targets != IGNORE].tolist())
    assert trained == sorted([100, 102, 7, 100, 101, 102, 8])


def test_same_target_shared_and_weights_add():
    # two identical views: one set of nodes, every weight is 2 (two N-pass loss terms)
    layout = build_layout([V([1, 2, 3], 1), V([1, 2, 3], 1)])
    assert len(layout) == 3
    assert layout.weights.tolist() == [2.0, 2.0, 0.0]


def test_divergent_targets_duplicate_the_node():
    # [1 2 | 3] and [1 2 | 4]: node 2 would need targets 3 and 4 -> second copy of 2
    layout = build_layout([V([1, 2, 3], 2), V([1, 2, 4], 2)])
    assert layout.input_ids.tolist() == [1, 2, 3, 2, 4]
    assert layout.targets.tolist() == [IGNORE, 3, IGNORE, 4, IGNORE]
    assert layout.kv_end.tolist() == [5, 3, 3, 5, 5]


def test_no_cross_document_attention_when_packed():
    a = build_layout([V([1, 2, 3], 1)])
    b = build_layout([V([4, 5], 1), V([4, 6], 1)])
    row = concat([a, b])
    for q in range(len(row)):
        visible = [k for k in range(len(row)) if k <= q < row.kv_end[k]]
        doc = 0 if q < len(a) else 1
        assert all((k < len(a)) == (doc == 0) for k in visible)


def test_one_pass_never_longer_than_n_pass():
    views = [V([1, 2, 3, 4], 2), V([1, 2, 5, 6, 7], 3), V([1, 2, 5, 6, 8, 9], 5)]
    assert len(build_layout(views)) <= sum(len(v) for v in views)


views_strategy = st.lists(
    st.tuples(st.lists(st.integers(0, 5), min_size=1, max_size=12), st.integers(0, 11)),
    min_size=1, max_size=8,
).map(lambda xs: [V(t, min(max(n, 1), len(t) - 1) if len(t) > 1 else 1) for t, n in xs])


@settings(max_examples=200, deadline=None)
@given(views_strategy)
def test_layout_invariants(views):
    layout = build_layout(views)
    L = len(layout)
    kv_end, pos = layout.kv_end, layout.position_ids
    assert np.all(kv_end > np.arange(L)) and np.all(kv_end <= L)  # kv_end[p] > p
    for p in range(L):
        # subtrees nest: every node inside p's subtree ends inside it
        assert np.all(kv_end[p:kv_end[p]] <= kv_end[p])
        # parents precede children: the node's ancestors by the mask rule are at depths 0..pos-1
        anc = [k for k in range(L) if k <= p < kv_end[k]]
        assert pos[anc].tolist() == list(range(pos[p] + 1))
        assert anc == ancestors_reference(layout, p)
    # every trained token of every view is a target exactly once (weights count the views)
    expected = sum(max(0, len(v) - max(v.num_prompt, 1)) for v in views)
    assert layout.weights.sum() == expected


def reference_layout(views, weights):
    """The trie spelled out: one dict of children per node, a node matches when its token is the view's
    and its target does not conflict (preferring one that has the view's next token as a child);
    depth-first with the largest subtree first (ties in creation order); kv_end = one past the subtree."""
    tokens, targets, wsum, children, roots = [], [], [], [], {}
    for view, weight in zip(views, weights):
        vt, tt = view.tokens.tolist(), view_targets(view).tolist()
        siblings = roots
        for i, (token, target) in enumerate(zip(vt, tt)):
            ok = [c for c in siblings.get(token, []) if IGNORE in (targets[c], target) or targets[c] == target]
            following = [c for c in ok if i + 1 < len(vt) and vt[i + 1] in children[c]]
            node = (following or ok or [None])[0]
            if node is None:
                node = len(tokens)
                tokens.append(token), targets.append(IGNORE), wsum.append(0.0), children.append({})
                siblings.setdefault(token, []).append(node)
            if target != IGNORE:
                targets[node], wsum[node] = target, wsum[node] + weight
            siblings = children[node]
    rows = []  # (node, depth); then kv_end from the subtree sizes

    def size(node):
        return 1 + sum(size(c) for ns in children[node].values() for c in ns)

    def visit(kids, depth):
        for node in sorted((n for ns in kids.values() for n in ns), key=lambda n: (-size(n), n)):
            start = len(rows)
            rows.append([node, depth, 0])
            visit(children[node], depth + 1)
            rows[start][2] = len(rows)

    visit(roots, 0)
    order = [r[0] for r in rows]
    return dict(input_ids=[tokens[n] for n in order], position_ids=[r[1] for r in rows],
                kv_end=[r[2] for r in rows], targets=[targets[n] for n in order], weights=[wsum[n] for n in order])


@settings(max_examples=300, deadline=None)
@given(views_strategy, st.lists(st.sampled_from([1.0, 0.5, 1 / 3]), min_size=8, max_size=8))
def test_tree_by_chains_and_segments_equals_the_node_by_node_reference(views, weights):
    tree = PrefixTree()
    for view, weight in zip(views, weights):
        tree.insert(view, weight)
    assert tree.dfs_order().tolist() == tree.dfs_order_reference().tolist()
    fast, reference = tree.layout(), tree.layout_reference()
    for c in COLUMNS:
        assert getattr(fast, c).dtype == getattr(reference, c).dtype
        np.testing.assert_array_equal(getattr(fast, c), getattr(reference, c))
    for c, values in reference_layout(views, weights).items():
        assert getattr(fast, c).tolist() == values, c


def test_parse_schedule():
    assert str(parse_schedule("k-pass:3")) == "k-pass:3"
    for bad in ("k-pass:0", "k-pass:x", "two-pass", ""):
        with pytest.raises(ValueError, match="unknown schedule"):
            parse_schedule(bad)


def test_contiguous_groups():
    assert contiguous_groups(5, 2) == [[0, 1, 2], [3, 4]]
    assert contiguous_groups(3, 6) == [[0], [1], [2]]
    assert contiguous_groups(6, 3) == [[0, 1], [2, 3], [4, 5]]


def _chain(n_turns):
    """Views of a chat where view i's prompt extends view i-1's prompt by 3 history tokens."""
    views, prompt = [], [1]
    for i in range(n_turns):
        views.append(V(prompt + [50 + i, 60 + i], len(prompt), turn=2 * i + 1))
        prompt = prompt + [60 + i, 70 + i, 80 + i]
    return views


@pytest.mark.parametrize("spec,groups", [
    ("n-pass", [[0], [1], [2], [3], [4]]),
    ("one-pass", [[0, 1, 2, 3, 4]]),
    ("k-pass:2", [[0, 1, 2], [3, 4]]),
])
def test_schedules_group_views(spec, groups):
    assert schedule_views(_chain(5), parse_schedule(spec)).groups == groups


def test_budget_splits_instead_of_dropping():
    views = _chain(5)
    out = schedule_views(views, parse_schedule("budget"), max_tokens=16)
    assert sorted(i for g in out.groups for i in g) == [0, 1, 2, 3, 4]
    assert all(len(x) <= 16 for x in out.layouts) and len(out.groups) > 1
    assert not out.skipped


def test_view_over_budget_is_skipped_and_reported():
    views = _chain(5)
    out = schedule_views(views, parse_schedule("n-pass"), max_tokens=10)
    assert out.num_views_skipped == 2  # views 3 and 4 have 12 and 15 tokens
    assert len(out.skipped) == 2 and "longer than max_tokens=10" in out.skipped[0]


def test_tree_over_budget_is_skipped_with_hint():
    out = schedule_views(_chain(5), parse_schedule("one-pass"), max_tokens=15)
    assert out.layouts == [] and out.num_views_skipped == 5
    assert "use --schedule budget" in out.skipped[0]


def test_weightings():
    views = [V([1, 2, 3, 4], 2), V([1, 2, 3, 5, 6, 7], 3)]  # 2 and 3 trained tokens
    assert view_weights(views, "token") == [1.0, 1.0]
    assert view_weights(views, "turn") == [0.5, 1 / 3]
    assert view_weights(views, "conversation") == [0.2, 0.2]
    with pytest.raises(ValueError, match="unknown weighting"):
        view_weights(views, "sample")


def test_count_new_matches_insert():
    tree = PrefixTree()
    for v in _chain(4):
        predicted = tree.count_new(v)
        assert tree.insert(v) == predicted


def test_best_fit_decreasing_docstring_example():
    assert best_fit_decreasing([7, 5, 4, 3, 1], 10) == [[0, 3], [1, 2, 4]]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 20), max_size=40), st.integers(20, 40))
def test_best_fit_fast_equals_reference(lengths, capacity):
    bins = best_fit_decreasing(lengths, capacity)
    assert bins == best_fit_reference(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)


def test_pack_layouts_keeps_every_token():
    layouts = [build_layout([v]) for v in _chain(4)]
    rows = pack_layouts(layouts, 16)
    assert sum(len(r) for r in rows) == sum(len(x) for x in layouts)
    assert all(len(r) <= 16 for r in rows)


def test_view_reuses_the_branch_it_continues():
    # h is duplicated for conflicting targets (2 vs 3); the third view continues "h 3",
    # so it must walk into the second copy of h, not the first
    layout = build_layout([V([1, 2], 1), V([1, 3], 1), V([1, 3, 4], 2)])
    assert len(layout) == 5


def test_rows_round_trip_through_columns_with_the_schema_dtypes():
    from onepass.layout.tree import COLUMNS, ROW_DISK_DTYPES, ROW_SCHEMA, row_from_columns, rows_to_columns

    assert COLUMNS == tuple(ROW_SCHEMA) == tuple(ROW_DISK_DTYPES) == (
        "input_ids", "position_ids", "kv_end", "targets", "weights")
    layout = build_layout([V([1, 2, 3], 1), V([1, 2, 4], 2)], weights=[0.5, 2.0])
    columns = rows_to_columns([layout, layout])
    assert list(columns) == list(COLUMNS) and len(columns["kv_end"]) == 2
    stored = {c: np.asarray(v[0], dtype=ROW_DISK_DTYPES[c]).tolist() for c, v in columns.items()}  # as on disk
    back = row_from_columns(stored)
    for c in COLUMNS:
        assert getattr(back, c).dtype == ROW_SCHEMA[c]
        assert np.array_equal(getattr(back, c), getattr(layout, c))
