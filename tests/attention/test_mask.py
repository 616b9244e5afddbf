"""Masks from kv_end against their references, and the paper's role-id mask against the tree."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onepass.attention.mask import (
    additive_mask,
    block_any,
    dense_mask,
    dense_mask_reference,
    generate_tree_mask_mod,
    pad_kv_end,
    sdpa_mask,
    tree_block_mask,
)
from onepass.attention.paper import (
    ROLE_HUMAN,
    ROLE_RESPONSE_IN,
    ROLE_RESPONSE_OUT,
    paper_layout,
    paper_role_mask,
    paper_turn_ids,
)
from onepass.layout.tree import IGNORE, ancestors_reference, build_layout, concat

from strategies import V, random_views  # noqa: E402

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


layout_st = random_views(8).map(build_layout)

# Conversations as segment lengths (human, reasoning, response); reasoning may be empty.
turns_st = st.lists(st.tuples(st.integers(1, 3), st.integers(0, 3), st.integers(1, 3)),
                    min_size=1, max_size=4)


def make_turns(lengths):
    """Unique token ids per segment, so views share exactly what the conversation shares."""
    turns, next_id = [], 100
    for lens in lengths:
        segs = []
        for n in lens:
            segs.append(list(range(next_id, next_id + n)))
            next_id += n
        turns.append(tuple(segs))
    return turns


def turn_views(turns):
    """The N-pass views: view i = [h1 r1 .. h_i | t_i r_i] (old reasoning dropped)."""
    views, history = [], []
    for h, t, r in turns:
        prompt = history + h
        views.append(V(prompt + t + r, len(prompt)))
        history = prompt + r
    return views


def paper_to_tree_order(p, layout):
    """Index in the paper's sequence of each node of the tree ``layout``.

    A node is found by its token and position: unique here (make_turns gives every segment its own
    ids; a response's two copies sit at different positions whenever the turn has reasoning, and
    has one copy when it has none). The tree never emits the last turn's ``r_in``, so that is the
    only index of the paper's left out.
    """
    where = {(int(t), int(q)): i for i, (t, q) in enumerate(zip(p.input_ids, p.position_ids))}
    assert len(where) == len(p)
    perm = np.asarray([where[int(t), int(q)] for t, q in zip(layout.input_ids, layout.position_ids)])
    left_out = np.setdiff1d(np.arange(len(p)), perm)
    assert len(set(perm.tolist())) == len(perm) and (p.role_ids[left_out] == ROLE_RESPONSE_IN).all()
    assert (p.turn_ids[left_out] == p.turn_ids.max()).all()
    return perm


def contexts(mask, input_ids, position_ids, predictors_targets):
    """{(tokens visible to p ordered by position, target)} for (p, target) pairs."""
    out = set()
    for p, target in predictors_targets:
        keys = np.flatnonzero(mask[p])
        keys = keys[np.argsort(position_ids[keys], kind="stable")]
        assert position_ids[keys].tolist() == list(range(len(keys)))
        out.add((tuple(input_ids[keys].tolist()), int(target)))
    return out


def view_pairs(views):
    """{(prefix, next token)} for every trained token of every view: the N-pass training set."""
    return {(tuple(v.tokens[:o].tolist()), int(v.tokens[o]))
            for v in views for o in range(max(v.num_prompt, 1), len(v.tokens))}


# --------------------------------------------------------------------------------------------
# kv_end -> dense masks


def test_docstring_example_paper_tree():
    h1, t1, r1, h2, t2, r2 = 1, 2, 3, 4, 5, 6
    # the docstring's order: t1's branch first (any depth-first order is a valid layout)
    kv_end = [7, 3, 3, 7, 7, 7, 7]
    expected = np.array([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 0, 0, 1, 0, 0, 0],
        [1, 0, 0, 1, 1, 0, 0],
        [1, 0, 0, 1, 1, 1, 0],
        [1, 0, 0, 1, 1, 1, 1],
    ], dtype=bool)
    assert (dense_mask(kv_end).numpy() == expected).all()
    assert (dense_mask_reference(kv_end) == expected).all()
    # build_layout lays the heavier branch (r1' h2 t2 r2) out first: the same mask, permuted
    layout = build_layout([V([h1, t1, r1], 1), V([h1, r1, h2, t2, r2], 3)])
    assert layout.input_ids.tolist() == [h1, r1, h2, t2, r2, t1, r1]
    assert layout.position_ids.tolist() == [0, 1, 2, 3, 4, 1, 2]
    assert layout.kv_end.tolist() == [7, 5, 5, 5, 5, 7, 7]
    perm = [0, 5, 6, 1, 2, 3, 4]  # docstring position -> build_layout position
    assert (dense_mask(layout.kv_end).numpy()[np.ix_(perm, perm)] == expected).all()


def test_causal_is_the_special_case_kv_end_equals_length():
    L = 5
    assert torch.equal(dense_mask(np.full(L, L)), torch.ones(L, L, dtype=torch.bool).tril())


@FAST
@given(layout_st)
def test_dense_mask_matches_reference(layout):
    assert (dense_mask(layout.kv_end).numpy() == dense_mask_reference(layout.kv_end)).all()
    assert (dense_mask(torch.as_tensor(layout.kv_end)).numpy() == dense_mask_reference(layout.kv_end)).all()


@FAST
@given(layout_st)
def test_mask_rows_are_tree_ancestors(layout):
    mask = dense_mask(layout.kv_end).numpy()
    for q in range(len(layout)):
        assert np.flatnonzero(mask[q]).tolist() == ancestors_reference(layout, q)


@FAST
@given(st.lists(layout_st, min_size=1, max_size=4))
def test_no_cross_document_attention(layouts):
    row = concat(layouts)
    doc = np.repeat(np.arange(len(layouts)), [len(x) for x in layouts])
    mask = dense_mask(row.kv_end).numpy()
    assert not (mask & (doc[:, None] != doc[None, :])).any()
    start = 0
    for x in layouts:
        end = start + len(x)
        assert (mask[start:end, start:end] == dense_mask_reference(x.kv_end)).all()
        start = end


@FAST
@given(st.lists(layout_st, min_size=1, max_size=3), st.integers(0, 5))
def test_batched_padded_rows(layouts, extra):
    length = max(len(x) for x in layouts) + extra
    kv_end_BL = pad_kv_end([x.kv_end for x in layouts], length)
    mask_BQK = dense_mask(kv_end_BL).numpy()
    assert mask_BQK.shape == (len(layouts), length, length)
    for b, x in enumerate(layouts):
        n = len(x)
        assert (mask_BQK[b] == dense_mask_reference(kv_end_BL[b])).all()
        assert (mask_BQK[b, :n, :n] == dense_mask_reference(x.kv_end)).all()
        # a pad sees only itself and nothing sees a pad: no row is ever fully masked
        assert (mask_BQK[b, n:] == np.eye(length, dtype=bool)[n:]).all()
        assert not mask_BQK[b, :, n:][~np.eye(length, dtype=bool)[:, n:]].any()
    assert mask_BQK.any(-1).all()


def test_pad_kv_end_by_hand():
    assert pad_kv_end([[3, 2, 3], [1]], 4).tolist() == [[3, 2, 3, 4], [1, 2, 3, 4]]
    with pytest.raises(ValueError, match="longest row"):
        pad_kv_end([[1, 2, 3]], 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_additive_and_sdpa_masks(dtype):
    kv_end_BL = pad_kv_end([[7, 3, 3, 7, 7, 7, 7], [2, 2]], 7)
    mask_BQK = dense_mask(kv_end_BL)
    add_B1QK = additive_mask(mask_BQK, dtype)
    assert add_B1QK.shape == (2, 1, 7, 7) and add_B1QK.dtype == dtype
    assert (add_B1QK[:, 0][mask_BQK] == 0).all()
    assert (add_B1QK[:, 0][~mask_BQK] == torch.finfo(dtype).min).all()
    for shaped in (mask_BQK[0], mask_BQK[:1], mask_BQK[:1, None]):  # [Q,K], [B,Q,K], [B,1,Q,K]
        assert torch.equal(sdpa_mask(shaped), mask_BQK[:1, None])
        assert torch.equal(additive_mask(shaped, dtype), add_B1QK[:1])
    with pytest.raises(ValueError, match="bool"):
        additive_mask(add_B1QK, dtype)


def test_sdpa_bool_and_additive_masks_attend_alike():
    torch.manual_seed(0)
    kv_end_BL = pad_kv_end([[7, 3, 3, 7, 7, 7, 7], [2, 2, 3]], 7)
    mask_BQK = dense_mask(kv_end_BL)
    q, k, v = torch.randn(3, 2, 2, 7, 4, dtype=torch.float64)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out_bool = sdpa(q, k, v, attn_mask=sdpa_mask(mask_BQK))
    out_add = sdpa(q, k, v, attn_mask=additive_mask(mask_BQK, torch.float64))
    scores = (q @ k.transpose(-1, -2)) / 2.0
    ref = scores.masked_fill(~mask_BQK[:, None], float("-inf")).softmax(-1) @ v
    torch.testing.assert_close(out_bool, ref)
    torch.testing.assert_close(out_add, ref)


# --------------------------------------------------------------------------------------------
# FlexAttention


@FAST
@given(st.lists(layout_st, min_size=1, max_size=3), st.integers(0, 3))
def test_mask_mod_matches_dense_mask(layouts, extra):
    kv_end_BL = torch.as_tensor(pad_kv_end([x.kv_end for x in layouts], max(map(len, layouts)) + extra))
    B, L = kv_end_BL.shape
    mask_mod = generate_tree_mask_mod(kv_end_BL)
    b = torch.arange(B)[:, None, None]
    q = torch.arange(L)[None, :, None]
    k = torch.arange(L)[None, None, :]
    got_BQK = mask_mod(b, torch.zeros((), dtype=torch.long), q, k)  # elementwise, by broadcasting
    assert torch.equal(got_BQK, dense_mask(kv_end_BL))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(layout_st, min_size=1, max_size=3), st.integers(0, 9), st.sampled_from([2, 4, 16]))
def test_block_mask_matches_dense_blocks(layouts, extra, block_size):
    from torch.nn.attention.flex_attention import create_mask

    kv_end_BL = torch.as_tensor(pad_kv_end([x.kv_end for x in layouts], max(map(len, layouts)) + extra))
    B, L = kv_end_BL.shape
    mask_BQK = dense_mask(kv_end_BL)
    block_mask = tree_block_mask(kv_end_BL, block_size=block_size, device="cpu")
    assert block_mask.to_dense().shape[:2] == (B, 1)
    assert torch.equal(block_mask.to_dense()[:, 0].bool(), block_any(mask_BQK, block_size))
    # the BlockMask's own mask_mod, evaluated by flex itself, is the dense mask exactly
    assert torch.equal(create_mask(block_mask.mask_mod, B, None, L, L, device="cpu")[:, 0], mask_BQK)


def test_block_any_by_hand():
    mask = dense_mask([7, 3, 3, 7, 7, 7, 7])
    # blocks of 3: rows {0,1,2} {3,4,5} {6}; cols likewise
    assert block_any(mask, 3).int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    mask = dense_mask([1, 2, 3, 4])  # every token sees only itself
    assert block_any(mask, 2).int().tolist() == [[1, 0], [0, 1]]


def test_tree_block_mask_accepts_numpy_1d():
    block_mask = tree_block_mask(np.array([7, 3, 3, 7, 7, 7, 7]), block_size=4)
    assert block_mask.to_dense().int().tolist() == [[[[1, 0], [1, 1]]]]


def _flex_vs_sdpa(device):
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(0)
    layout = build_layout(turn_views(make_turns([(3, 4, 2), (2, 0, 3), (1, 5, 2)])))
    kv_end_BL = torch.as_tensor(pad_kv_end([layout.kv_end, layout.kv_end[:5]], len(layout) + 3),
                                device=device)
    B, L = kv_end_BL.shape
    q, k, v = torch.randn(3, B, 2, L, 8, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        out = flex_attention(q, k, v, block_mask=tree_block_mask(kv_end_BL, block_size=16))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask(dense_mask(kv_end_BL)))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_flex_attention_forward_matches_sdpa_cpu():
    _flex_vs_sdpa("cpu")


@pytest.mark.requires_cuda
def test_flex_attention_forward_matches_sdpa_cuda():
    _flex_vs_sdpa("cuda")


@pytest.mark.requires_cuda
def test_masks_built_on_cuda_match_cpu():
    kv_end = pad_kv_end([[7, 3, 3, 7, 7, 7, 7], [2, 2]], 9)
    assert torch.equal(dense_mask(kv_end, device="cuda").cpu(), dense_mask(kv_end))
    bm = tree_block_mask(torch.as_tensor(kv_end, device="cuda"), block_size=4)
    assert torch.equal(bm.to_dense().cpu(), tree_block_mask(kv_end, block_size=4).to_dense())


# --------------------------------------------------------------------------------------------
# The paper's layout and role-id mask


def test_paper_layout_by_hand():
    # turn 1: h=[1] t=[2] r=[3]; turn 2: h=[4] t=[] r=[6] (no reasoning: no duplicate)
    p = paper_layout([([1], [2], [3]), ([4], [], [6])])
    assert p.input_ids.tolist() == [1, 2, 3, 3, 4, 6]
    assert p.role_ids.tolist() == [1, 2, 3, 4, 1, 3]
    assert p.turn_ids.tolist() == [1, 1, 1, 1, 2, 2]
    assert p.position_ids.tolist() == [0, 1, 1, 2, 2, 3]  # r_in starts where t starts
    assert p.labels.tolist() == [IGNORE, 2, IGNORE, 3, IGNORE, IGNORE]
    expected = np.array([
        [1, 0, 0, 0, 0, 0],   # h1
        [1, 1, 0, 0, 0, 0],   # t1
        [1, 0, 1, 0, 0, 0],   # r1_in: not its reasoning
        [1, 1, 0, 1, 0, 0],   # r1_out: its reasoning, not r1_in
        [1, 0, 1, 0, 1, 0],   # h2: history = h1 r1_in
        [1, 0, 1, 0, 1, 1],   # r2 (single copy)
    ], dtype=bool)
    assert (paper_role_mask(p.role_ids, p.turn_ids) == expected).all()


@FAST
@given(turns_st)
def test_paper_turn_ids_follow_human_runs(lengths):
    p = paper_layout(make_turns(lengths))
    assert (paper_turn_ids(p.role_ids) == p.turn_ids).all()
    padded = np.concatenate([p.role_ids, [0, 0]])[None]
    assert (paper_turn_ids(padded)[0] == np.concatenate([p.turn_ids, [0, 0]])).all()


@FAST
@given(turns_st)
def test_paper_role_mask_equals_tree_mask(lengths):
    turns = make_turns(lengths)
    p = paper_layout(turns)
    layout = build_layout(turn_views(turns))
    perm = paper_to_tree_order(p, layout)
    assert p.input_ids[perm].tolist() == layout.input_ids.tolist()
    assert p.position_ids[perm].tolist() == layout.position_ids.tolist()
    paper_mask = paper_role_mask(p.role_ids, p.turn_ids)
    assert (paper_mask[np.ix_(perm, perm)] == dense_mask(layout.kv_end).numpy()).all()
    # the dropped last r_in sees only h<=N and r_in<=N: nothing else needed it
    dropped = np.setdiff1d(np.arange(len(p)), perm)
    assert not paper_mask[np.ix_(perm, dropped)].any()


def test_paper_role_mask_relies_on_response_in_before_response_out():
    # The published expression lets r_in attend to its own turn's r_out whenever r_out
    # comes first; only the paper's order (r_in first) plus causality hides it. Turn 1's reasoning is
    # long, so its trained branch (t1 r_out) is the heavier and the tree lays it out before r_in.
    turns = make_turns([(2, 5, 2), (1, 1, 1)])
    p = paper_layout(turns)
    layout = build_layout(turn_views(turns))
    perm = paper_to_tree_order(p, layout)
    roles, turn = p.role_ids[perm], p.turn_ids[perm]
    wrong = paper_role_mask(roles, turn)
    diff = wrong != dense_mask(layout.kv_end).numpy()
    q, k = np.nonzero(diff)
    assert len(q) > 0 and wrong[q, k].all()
    assert (roles[q] == ROLE_RESPONSE_IN).all() and (roles[k] == ROLE_RESPONSE_OUT).all()
    assert (turn[q] == turn[k]).all()


def test_paper_standard_shift_predicts_first_response_from_wrong_position():
    """With the usual shift (position p predicts labels[p + 1]) the paper's first response token
    of each turn is predicted at the last token of r_in: a context holding the whole answer and
    none of the reasoning, at position start + |r| - 1 instead of start + |t| - 1. Every other
    trained token sees exactly its N-pass prefix. The tree's pre-shifted targets predict it from
    the last reasoning token and match the N-pass set exactly."""
    lengths = [(3, 4, 2), (2, 2, 3), (1, 3, 5)]
    turns = make_turns(lengths)
    views = turn_views(turns)
    expected = view_pairs(views)

    p = paper_layout(turns)
    paper_mask = paper_role_mask(p.role_ids, p.turn_ids)
    shifted = [(j - 1, p.labels[j]) for j in range(1, len(p)) if p.labels[j] != IGNORE]
    paper_pairs = contexts(paper_mask, p.input_ids, p.position_ids, shifted)

    layout = build_layout(views)
    tree_pairs = contexts(dense_mask(layout.kv_end).numpy(), layout.input_ids, layout.position_ids,
                          [(i, t) for i, t in enumerate(layout.targets) if t != IGNORE])
    assert tree_pairs == expected

    first_out = [int(np.flatnonzero((p.role_ids == ROLE_RESPONSE_OUT) & (p.turn_ids == i))[0])
                 for i in range(1, len(turns) + 1)]
    wrong = {(ctx, tgt) for ctx, tgt in expected if tgt in {int(p.input_ids[j]) for j in first_out}}
    assert expected - paper_pairs == wrong and len(wrong) == len(turns)
    assert len(paper_pairs - expected) == len(turns)
    for i, j in enumerate(first_out):
        h, t, r = turns[i]
        predictor = j - 1
        assert p.role_ids[predictor] == ROLE_RESPONSE_IN and p.input_ids[predictor] == r[-1]
        start = int(p.position_ids[j]) - len(t)  # position of the first token after h_i
        assert p.position_ids[predictor] == start + len(r) - 1
        # the tree predicts r[0] at the last reasoning token, position start + |t| - 1
        tree_predictor = int(np.flatnonzero(layout.targets == r[0])[0])
        assert layout.input_ids[tree_predictor] == t[-1]
        assert layout.position_ids[tree_predictor] == start + len(t) - 1
        # the paper's predictor sees the answer it is asked to predict, and no reasoning
        visible = set(p.input_ids[paper_mask[predictor]].tolist())
        assert set(r) <= visible and not (set(t) & visible)


def test_paper_does_not_train_turns_without_reasoning():
    # Published code: `duplicate = len(reasoning_ids) != 0`; the single copy is role 3, labels
    # IGNORE. So a turn without reasoning is never trained; the tree trains it.
    turns = make_turns([(2, 2, 2), (2, 0, 3), (1, 1, 1)])
    p = paper_layout(turns)
    _, _, r2 = turns[1]
    in_turn2 = p.turn_ids == 2
    assert set(p.role_ids[in_turn2].tolist()) == {ROLE_HUMAN, ROLE_RESPONSE_IN}
    assert (p.labels[in_turn2] == IGNORE).all()
    layout = build_layout(turn_views(turns))
    trained = set(layout.targets[layout.targets != IGNORE].tolist())
    assert set(r2) <= trained
    assert not set(r2) & set(p.labels[p.labels != IGNORE].tolist())


def test_paper_layout_rejects_empty_human_or_response():
    with pytest.raises(ValueError, match="turn 2"):
        paper_layout([([1], [2], [3]), ([], [5], [6])])



@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_every_flex_forward_asks_for_the_main_kernel(monkeypatch):
    """Every onepass forward of a flex_attention model (the one-pass row and the N-pass reference) hands
    transformers' flex_attention FLEX_KERNEL_OPTIONS: on an H100 (torch 2.11) a 125-token N-pass view of a
    tiny grouped-query Qwen3 fell to torch's flex-decoding kernel, which found no kernel at all (verify
    with --attn flex_attention failed at compile). Here flex runs eagerly on CPU (forward only) and the
    options are read where transformers would pass them to torch."""
    import transformers.integrations.flex_attention as hf_flex
    from torch.nn.attention.flex_attention import flex_attention

    from onepass.attention.backends import FLEX_KERNEL_OPTIONS, forward_kwargs
    from onepass.loss import layout_loss, view_loss_reference
    from onepass.model.tiny import tiny_model
    from onepass.layout.view import View

    seen = []

    def eager_flex(query, key, value, training=False, **kwargs):
        seen.append(kwargs.get("kernel_options"))
        return flex_attention(query, key, value, **kwargs)

    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention", eager_flex)
    model = tiny_model("qwen3", 64, attn_implementation="flex_attention")
    assert forward_kwargs(model) == {"kernel_options": FLEX_KERNEL_OPTIONS}
    assert forward_kwargs(tiny_model("qwen3", 64)) == {}  # sdpa: nothing extra
    view = View(tokens=np.arange(1, 13), num_prompt=5, turn=1)
    tree = build_layout([view, View(tokens=np.array([*range(1, 8), 20, 21, 22]), num_prompt=7, turn=3)])
    with torch.no_grad():
        view_loss_reference(model, view)
        layout_loss(model, tree)
    num_layers = model.config.num_hidden_layers
    assert len(seen) == 2 * num_layers and all(o == FLEX_KERNEL_OPTIONS for o in seen), seen


def test_flex_in_float64_is_refused_in_one_line_and_never_chosen():
    """flex_attention has no float64 kernel (on the first H100 run Triton failed to compile its template
    for float64: a 100-line traceback from `onepass verify --dtype float64 --attn flex_attention`)."""
    from onepass.attention.backends import BackendError, check_backend, supported_backend
    from onepass.model.tiny import tiny_config

    with pytest.raises(BackendError, match="no float64 kernel"):
        check_backend("flex_attention", "cuda", torch.float64)
    check_backend("flex_attention", "cuda", torch.float32)
    check_backend("sdpa", "cuda", torch.float64)
    config = tiny_config("qwen3", 64)
    assert supported_backend(config, "cuda", torch.float32) == "flex_attention"
    assert supported_backend(config, "cuda", torch.float64) == "sdpa"
