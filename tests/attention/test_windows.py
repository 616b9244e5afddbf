"""Sliding windows and attention sinks on every backend, against dense references.

The rule under test (:mod:`onepass.attention.mask`): q sees k iff
``k <= q < kv_end[k] and pos[q] - pos[k] < W``; with sinks, every softmax has
one more logit per head. Dense masks, the FlexAttention ``mask_mod`` and
``BlockMask``, the block plan, the segment plan and the ``onepass_cpu``
kernel are each compared with a slow reference on random trees and windows.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import onepass.attention.cpu as cpu
from onepass.attention.blocks import EMPTY, FULL, block_plan, block_plan_reference
from onepass.attention.segments import plan_pairs_reference
from onepass.attention.segments import segment_plan
from onepass.attention.cpu import cpu_attention_mask
from onepass.attention.cpu_tiles import CpuAttentionError, dense_attention, tree_attention, tree_attention_reference
from onepass.attention.mask import dense_mask, dense_mask_reference, generate_tree_mask_mod, pad_kv_end
from onepass.attention.mask import block_mask, tree_block_mask
from onepass.attention.window import window_start
from onepass.geometry import depths
from onepass.tree import build_layout, concat

from strategies import V, layout_st  # noqa: E402

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOL = 1e-9

# the tree of onepass.attention.mask's docstring: h1 | t1 r1 (view 1) and h1 r1' h2 | t2 r2 (view 2)
DOC_KV_END, DOC_POS = [7, 3, 3, 7, 7, 7, 7], [0, 1, 2, 1, 2, 3, 4]
windows_st = st.sampled_from([1, 2, 3, 5, 8, 64])


@st.composite
def rows_st(draw, max_extra_pad=5):
    """(kv_end [B, L], position_ids [B, L]) of packed, padded rows of random trees."""
    rows = [concat(draw(st.lists(layout_st, min_size=1, max_size=3))) for _ in range(draw(st.integers(1, 3)))]
    L = max(map(len, rows)) + draw(st.integers(0, max_extra_pad))
    pos_BL = np.zeros((len(rows), L), dtype=np.int64)  # pads: position 0, a root of their own
    for b, row in enumerate(rows):
        pos_BL[b, :len(row)] = row.position_ids
    return pad_kv_end([r.kv_end for r in rows], L), pos_BL


# --------------------------------------------------------------------------------------------
# the rule, by hand and against the double loop


def test_docstring_example_window_3():
    grid = dense_mask(DOC_KV_END, position_ids=DOC_POS, window=3).int().tolist()
    assert grid == [[1, 0, 0, 0, 0, 0, 0],   # h1
                    [1, 1, 0, 0, 0, 0, 0],   # t1
                    [1, 1, 1, 0, 0, 0, 0],   # r1
                    [1, 0, 0, 1, 0, 0, 0],   # r1'
                    [1, 0, 0, 1, 1, 0, 0],   # h2
                    [0, 0, 0, 1, 1, 1, 0],   # t2: positions 1..3
                    [0, 0, 0, 0, 1, 1, 1]]   # r2: positions 2..4, as in the plain view [h1 r1' h2 t2 r2]
    assert depths(np.array([DOC_KV_END])).tolist() == [DOC_POS]
    assert window_start(DOC_KV_END, DOC_POS, 3).tolist() == [[0, 0, 0, 0, 0, 3, 4]]


def test_a_view_alone_is_transformers_window():
    from transformers.masking_utils import sliding_window_causal_mask_function

    L, W = 11, 4
    fn = sliding_window_causal_mask_function(W)
    want = torch.tensor([[bool(fn(0, 0, torch.tensor(q), torch.tensor(k))) for k in range(L)] for q in range(L)])
    assert torch.equal(dense_mask([L] * L, position_ids=list(range(L)), window=W), want)


@FAST
@given(layout_st, windows_st)
def test_dense_window_mask_matches_reference_and_window_start(layout, window):
    got = dense_mask(layout.kv_end, position_ids=layout.position_ids, window=window).numpy()
    assert (got == dense_mask_reference(layout.kv_end, layout.position_ids, window)).all()
    start_L = window_start(layout.kv_end, layout.position_ids, window)[0]
    idx = np.arange(len(layout))
    index_form = (start_L[:, None] <= idx[None, :]) & (idx[None, :] <= idx[:, None]) & (
        idx[:, None] < np.asarray(layout.kv_end)[None, :])
    assert (got == index_form).all()


def test_positions_that_are_not_depths_are_refused():
    with pytest.raises(ValueError, match=r"position_ids\[0, 2\] = 5 is not its parent's \+ 1"):
        window_start(DOC_KV_END, [0, 1, 5, 1, 2, 3, 4], 3)
    with pytest.raises(ValueError, match="needs the rows' position_ids"):
        dense_mask(DOC_KV_END, window=3)
    with pytest.raises(ValueError, match="int >= 1"):
        dense_mask(DOC_KV_END, position_ids=DOC_POS, window=0)


# --------------------------------------------------------------------------------------------
# FlexAttention: mask_mod, BlockMask (create_block_mask and the one built from the plan)


@FAST
@given(rows_st(), windows_st)
def test_window_mask_mod_matches_dense(rows, window):
    kv_end_BL, pos_BL = (torch.as_tensor(x) for x in rows)
    B, L = kv_end_BL.shape
    mask_mod = generate_tree_mask_mod(kv_end_BL, pos_BL, window)
    got = mask_mod(torch.arange(B)[:, None, None], torch.zeros((), dtype=torch.long),
                   torch.arange(L)[None, :, None], torch.arange(L)[None, None, :])
    assert torch.equal(got, dense_mask(kv_end_BL, position_ids=pos_BL, window=window))


@FAST
@given(rows_st(), windows_st, st.sampled_from([1, 2, 3, 4, 16]))
def test_window_block_plan_is_sound_and_full_tiles_exact(rows, window, block_size):
    kv_end_BL, pos_BL = rows
    got = block_plan(kv_end_BL, block_size, position_ids=pos_BL, window=window).kind_BMN
    want = block_plan_reference(kv_end_BL, block_size, position_ids=pos_BL, window=window).kind_BMN
    assert ((got == FULL) == (want == FULL)).all()  # FULL skips the mask_mod: must be exact
    assert ((want != EMPTY) <= (got != EMPTY)).all()  # never skip a tile with a visible pair


@pytest.mark.parametrize("window", [1, 3, 8])
def test_window_block_plan_is_exact_on_packed_documents(window):
    docs = [build_layout([V(list(range(n)), 0)]) for n in (9, 4, 13)]
    row = concat(docs)
    for block_size in (2, 3, 4):
        got = block_plan(row.kv_end, block_size, position_ids=row.position_ids, window=window).kind_BMN
        want = block_plan_reference(row.kv_end, block_size, position_ids=row.position_ids, window=window)
        assert (got == want.kind_BMN).all()
    plan = block_plan([16] * 16, 4, position_ids=list(range(16)), window=5)
    assert plan.grid() == "p . . .\np p . .\n. p p .\n. . p p"  # a band: the far tiles are skipped


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows_st(), windows_st, st.sampled_from([2, 4, 16]))
def test_window_block_masks_evaluate_to_the_dense_mask(rows, window, block_size):
    from torch.nn.attention.flex_attention import create_mask

    kv_end_BL, pos_BL = (torch.as_tensor(x) for x in rows)
    B, L = kv_end_BL.shape
    want = dense_mask(kv_end_BL, position_ids=pos_BL, window=window)
    direct = block_mask(kv_end_BL, block_size=block_size, position_ids=pos_BL, window=window)
    created = tree_block_mask(kv_end_BL, block_size=block_size, position_ids=pos_BL, window=window)
    plan = block_plan(kv_end_BL, block_size, position_ids=pos_BL, window=window)
    assert int(direct.full_kv_num_blocks.sum()) == plan.num_full == int(created.full_kv_num_blocks.sum())
    for bm in (direct, created):
        assert torch.equal(create_mask(bm.mask_mod, B, None, L, L, device="cpu")[:, 0], want)
        # every visible pair lies in a tile the BlockMask visits
        visits = bm.to_dense()[:, 0].bool().repeat_interleave(block_size, 1).repeat_interleave(block_size, 2)
        assert not (want & ~visits[:, :L, :L]).any()


def test_flex_forward_with_a_window_matches_dense_cpu():
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(0)
    layout = build_layout([V(list(range(30)), 4), V(list(range(12)) + [40] * 20, 14)])
    short = build_layout([V(list(range(9)), 2)])
    kv_end_BL = torch.as_tensor(pad_kv_end([layout.kv_end, short.kv_end], len(layout) + 3))
    pos_BL = torch.zeros_like(kv_end_BL)
    pos_BL[0, :len(layout)], pos_BL[1, :9] = torch.as_tensor(layout.position_ids), torch.arange(9)
    B, L = kv_end_BL.shape
    q, k, v = torch.randn(3, B, 2, L, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        out = flex_attention(q, k, v, block_mask=block_mask(kv_end_BL, block_size=8, position_ids=pos_BL, window=6))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=dense_mask(kv_end_BL, position_ids=pos_BL, window=6)[:, None])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# onepass_cpu: windowed segment plan, sinks, latent attention


@FAST
@given(rows_st(), windows_st, st.sampled_from([1, 3, 16, 128]))
def test_window_segment_plan_computes_each_visible_pair_once(rows, window, chunk):
    kv_end_BL, pos_BL = rows
    plan = segment_plan(kv_end_BL, chunk=chunk, position_ids=pos_BL, window=window)
    assert plan.chunk <= max(window - 1, 1)
    want = torch.block_diag(*dense_mask(kv_end_BL, position_ids=pos_BL, window=window).int()).numpy()
    assert (plan_pairs_reference(plan) == want).all()
    for r in range(len(plan.rect_R4)):  # no query of a rectangle is left with no visible key (NaN)
        visible = plan.rect_visible(r)
        assert visible is None or visible.any(1).all()
        assert plan.rect_R4[r, 3] - plan.rect_lo_R[r] < window  # keys only inside the window


def random_qkv(B, L, *, heads=4, kv_heads=2, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, heads, L, dim), (B, kv_heads, L, dim), (B, kv_heads, L, dim), (heads,)]
    return [torch.randn(s, generator=gen, dtype=torch.float64).requires_grad_() for s in shapes]


def assert_cpu_matches_dense(kv_end_BL, pos_BL, window, *, chunk=128, sinks=True, heads=(4, 2), seed=0):
    q, k, v, s = random_qkv(*np.shape(kv_end_BL), heads=heads[0], kv_heads=heads[1], seed=seed)
    s = s if sinks else None
    plan = segment_plan(kv_end_BL, chunk=chunk, position_ids=pos_BL, window=window)
    out = tree_attention(q, k, v, plan, sinks=s)
    ref = tree_attention_reference(q, k, v, kv_end_BL, position_ids=pos_BL, window=window, sinks=s)
    torch.testing.assert_close(out, ref, atol=TOL, rtol=TOL)
    inputs = [q, k, v] + ([s] if sinks else [])
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    for got, want in zip(torch.autograd.grad(out, inputs, g), torch.autograd.grad(ref, inputs, g)):
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows_st(), st.sampled_from([None, 1, 2, 3, 5, 8]), st.sampled_from([1, 3, 16, 128]), st.booleans(),
       st.sampled_from([(4, 2), (2, 2), (6, 1)]))
def test_tree_attention_with_window_and_sinks_equals_dense(rows, window, chunk, sinks, heads):
    assert_cpu_matches_dense(*rows, window, chunk=chunk, sinks=sinks, heads=heads)


@pytest.mark.parametrize("window, chunk", [(16, 128), (16, 5), (40, 16)])
def test_long_segments_with_a_window(window, chunk):
    a = build_layout([V(list(range(90)), 30), V(list(range(60)) + list(range(100, 170)), 70)])
    b = build_layout([V(list(range(40)), 1)])
    row = concat([a, b])
    kv_end_BL = pad_kv_end([row.kv_end, b.kv_end], len(row) + 5)
    pos_BL = np.zeros_like(kv_end_BL)
    pos_BL[0, :len(row)], pos_BL[1, :len(b)] = row.position_ids, b.position_ids
    plan = segment_plan(kv_end_BL, chunk=chunk, position_ids=pos_BL, window=window)
    assert any(plan.rect_visible(r) is not None for r in range(len(plan.rect_R4)))  # some cut rectangles
    assert_cpu_matches_dense(kv_end_BL, pos_BL, window, chunk=chunk)


def test_dropping_the_sinks_or_the_window_differs():
    """The comparisons above can fail: without the sinks, or with the window off, the output moves."""
    kv_end_BL, pos_BL = np.full((1, 12), 12), np.arange(12)[None]  # one causal row
    q, k, v, s = random_qkv(1, 12)
    ref = tree_attention_reference(q, k, v, kv_end_BL, position_ids=pos_BL, window=3, sinks=s)
    for plan, sinks in ((segment_plan(kv_end_BL, position_ids=pos_BL, window=3), None),
                        (segment_plan(kv_end_BL), s)):
        assert (tree_attention(q, k, v, plan, sinks=sinks) - ref).abs().max() > 1e-3


def test_backend_checks_the_layer_window_and_pads_latent_heads():
    module = torch.nn.Module()
    module.layer_idx = 3
    kv_end_BL, pos_BL = torch.as_tensor([DOC_KV_END]), torch.as_tensor([DOC_POS])
    q, k, v, s = random_qkv(1, 7, dim=12)
    v = v[..., :8].detach().requires_grad_()  # latent attention: value heads narrower than query/key heads
    mask = cpu_attention_mask(kv_end_BL, position_ids=pos_BL, window=3)
    with pytest.raises(CpuAttentionError, match="layer 3 has sliding_window=None but .* window=3"):
        cpu.onepass_cpu_attention(module, q, k, v, mask, s_aux=s)
    out, _ = cpu.onepass_cpu_attention(module, q, k, v, mask, sliding_window=3, s_aux=s, scaling=0.3)
    ref = dense_attention(q, k, v, dense_mask(kv_end_BL, position_ids=pos_BL, window=3)[:, None],
                              scale=0.3, sinks=s)
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=TOL, rtol=TOL)
    g = torch.randn(out.shape, dtype=out.dtype)
    for got, want in zip(torch.autograd.grad(out, (q, k, v, s), g),
                         torch.autograd.grad(ref.transpose(1, 2), (q, k, v, s), g)):
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)


def test_sinks_without_our_mask_follow_the_models_eager_math():
    """N-pass views through onepass_cpu (transformers' own mask, or none) keep their sinks."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = torch.nn.Module()
    q, k, v, s = random_qkv(1, 9)
    module.sinks, module.num_key_value_groups, module.training = s, 2, False
    causal_11QK = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]
    additive = torch.zeros(1, 1, 9, 9, dtype=torch.float64).masked_fill(~causal_11QK, torch.finfo(torch.float64).min)
    want, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.25)
    for mask in (None, causal_11QK, additive):
        got, _ = cpu.onepass_cpu_attention(module, q, k, v, mask, scaling=0.25, s_aux=s)
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
