"""The one FLOP accounting: visible pairs against slow references, the formula, and its users agreeing."""

from __future__ import annotations

import doctest
import json
from dataclasses import replace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import V, batch_strategy, layout_st, views_st

import onepass.layout.flops
from onepass.layout.flops import (
    MODEL_SHAPES,
    TokenCounts,
    causal_pairs,
    conversation_counts,
    flops,
    forward_flops,
    model_kwargs,
    model_shape,
    token_ratio,
    train_flops,
    visible_pairs,
)
from onepass.layout.tree import ancestors_reference, build_layout, concat

FAST = settings(max_examples=60, deadline=None)


def pairs_reference(kv_end) -> int:
    """Slow reference: build the dense mask pair by pair from the rule k <= q < kv_end[k]."""
    kv_end_BL = np.atleast_2d(np.asarray(kv_end))
    B, L = kv_end_BL.shape
    return sum(1 for b in range(B) for q in range(L) for k in range(L) if k <= q < kv_end_BL[b, k])


def test_docstring_worked_example():
    result = doctest.testmod(onepass.layout.flops)
    assert result.attempted >= 5 and result.failed == 0


def test_six_node_example_by_hand():
    row = build_layout([V([1, 2, 3, 4], 2), V([1, 2, 5, 6], 3)])
    # mask rows (queries) see 1, 2, 3, 4, 3, 4 keys
    assert visible_pairs(row) == visible_pairs(row.kv_end) == pairs_reference(row.kv_end) == 17
    assert train_flops([row], MODEL_SHAPES["qwen3-0.6b"], dense=True) > train_flops([row], MODEL_SHAPES["qwen3-0.6b"])


@FAST
@given(layout_st)
def test_visible_pairs_of_a_tree_equals_the_dense_mask_and_the_ancestor_walk(layout):
    n = visible_pairs(layout)
    assert n == pairs_reference(layout.kv_end)
    assert n == sum(len(ancestors_reference(layout, q)) for q in range(len(layout)))
    assert n == int((layout.position_ids + 1).sum())  # a node sees its ancestors and itself


@FAST
@given(batch_strategy(max_extra_pad=5))
def test_visible_pairs_of_packed_padded_rows_equals_the_dense_mask(kv_end_BL):
    assert visible_pairs(kv_end_BL) == pairs_reference(kv_end_BL)


@FAST
@given(batch_strategy(max_extra_pad=5))
def test_the_cpu_plan_counts_the_same_visible_pairs(kv_end_BL):
    from onepass.attention.segments import segment_plan

    assert segment_plan(kv_end_BL, chunk=3).visible_pairs == visible_pairs(kv_end_BL)


@FAST
@given(views_st)
def test_conversation_counts_against_views_and_a_causal_reference(views):
    layout = build_layout(views)
    c = conversation_counts(views, layout)
    assert c.views == len(views) and c.n_pass_tokens == sum(len(v) for v in views)
    assert c.n_pass_pairs == sum(pairs_reference(np.full(len(v), len(v))) for v in views)  # causal views
    assert c.one_pass_tokens == len(layout) <= c.n_pass_tokens
    assert c.one_pass_pairs == visible_pairs(layout) <= c.n_pass_pairs
    assert c.targets == layout.num_targets
    assert c.token_ratio == token_ratio(c.n_pass_tokens, c.one_pass_tokens) >= 1.0


@FAST
@given(st.lists(layout_st, min_size=1, max_size=3), st.sampled_from(sorted(MODEL_SHAPES)))
def test_train_flops_is_three_forwards_of_the_counted_work(layouts, name):
    shape, row = MODEL_SHAPES[name], concat(layouts)
    per = (shape.linear_flops_per_token, shape.attention_flops_per_pair, shape.head_flops_per_target)
    for rows in ([row], layouts):
        tokens, targets = sum(len(r) for r in rows), sum(r.num_targets for r in rows)
        pairs = sum(pairs_reference(r.kv_end) for r in rows)
        assert train_flops(rows, shape) == 3 * (per[0] * tokens + per[1] * pairs + per[2] * targets)
        dense = sum(pairs_reference(np.full(len(r), len(r))) for r in rows)
        assert train_flops(rows, shape, dense=True) == 3 * forward_flops(shape, tokens=tokens, pairs=dense,
                                                                          targets=targets)


def test_a_chain_costs_the_same_dense_or_visible():
    chain = build_layout([V([5, 6, 7, 8, 9], 2)])  # one view: causal, nothing to skip
    shape = MODEL_SHAPES["tiny"]
    assert visible_pairs(chain) == causal_pairs(5) == 15
    assert train_flops([chain], shape) == train_flops([chain], shape, dense=True)


def test_n_pass_and_one_pass_flops_share_the_head():
    shape = replace(MODEL_SHAPES["qwen3-0.6b"], name="x")
    counts = TokenCounts(n_pass_tokens=10, one_pass_tokens=10, n_pass_pairs=31, one_pass_pairs=31, targets=4)
    n, one = flops(counts, shape)
    assert n == one == forward_flops(shape, tokens=10, pairs=31, targets=4)
    assert flops(replace(counts, targets=5), shape)[0] - n == shape.head_flops_per_target


def test_model_kwargs_round_trip_through_a_config(tmp_path):
    for name, shape in MODEL_SHAPES.items():
        config = {**model_kwargs(shape), "vocab_size": shape.vocab}
        (tmp_path / f"{name}.json").write_text(json.dumps(config))
        back = model_shape(str(tmp_path / f"{name}.json"))
        assert replace(back, name=name) == shape


def test_token_ratio_of_nothing_is_zero():
    assert token_ratio(0, 0) == 0.0 and TokenCounts().token_ratio == 0.0
    assert token_ratio(12, 8) == 1.5
