"""Block plans from kv_end against the dense mask, and the directly built BlockMask against create_block_mask."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onepass.attention.blocks import (
    EMPTY,
    FULL,
    PARTIAL,
    block_plan,
    block_plan_reference,
)
from onepass.attention.segments import plan_pairs_reference, segment_plan
from onepass.attention.mask import block_any, block_mask, dense_mask, pad_kv_end, sdpa_mask, tree_block_mask
from onepass.tree import build_layout, concat

from strategies import DOC_EXAMPLE, SCATTERED, V, layout_st, batch_strategy  # noqa: E402

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

batch_st = batch_strategy(9)


def dense_kinds(kv_end_BL, block_size):
    """Tile classes by reducing onepass.attention.mask.dense_mask (cut tiles padded with hidden pairs)."""
    mask_BQK = dense_mask(kv_end_BL)
    L = mask_BQK.shape[-1]
    N = -(-L // block_size)
    pad = N * block_size - L
    tiles = torch.nn.functional.pad(mask_BQK, (0, pad, 0, pad)).reshape(-1, N, block_size, N, block_size)
    full_BMN = tiles.all(dim=4).all(dim=2)
    return (block_any(mask_BQK, block_size).int() + full_BMN.int()).numpy()


def test_docstring_example():
    plan = block_plan(DOC_EXAMPLE, 2)
    assert plan.grid() == "p . . .\nF p . .\nF . p .\nF . F p"
    assert (plan.num_partial, plan.num_full, plan.num_empty) == (4, 4, 8)
    assert (EMPTY, PARTIAL, FULL) == (0, 1, 2)


def test_causal_row_by_hand():
    # plain causal: kv_end = L everywhere; blocks of 3 over 7 tokens (last block cut)
    plan = block_plan([7] * 7, 3)
    assert plan.grid() == "p . .\nF p .\np p p"  # the cut row block is never full


@FAST
@given(batch_st, st.sampled_from([1, 2, 3, 4, 16]))
def test_block_plan_is_the_dense_mask_reduced(kv_end_BL, block_size):
    plan = block_plan(kv_end_BL, block_size)
    assert plan.kind_BMN.shape[0] == kv_end_BL.shape[0]
    assert (plan.kind_BMN == dense_kinds(kv_end_BL, block_size)).all()
    assert (plan.kind_BMN == block_plan_reference(kv_end_BL, block_size).kind_BMN).all()


@FAST
@given(st.lists(layout_st, min_size=1, max_size=4), st.sampled_from([2, 5]))
def test_block_plan_of_a_packed_row_1d(layouts, block_size):
    row = concat(layouts)
    plan = block_plan(row.kv_end, block_size)
    assert (plan.kind_BMN == dense_kinds(row.kv_end[None], block_size)).all()


def assert_same_block_mask(got, want):
    assert torch.equal(got.to_dense(), want.to_dense())
    assert got.shape == want.shape and got.BLOCK_SIZE == want.BLOCK_SIZE
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name).cpu()), name


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch_st, st.sampled_from([2, 4, 16]))
def test_direct_block_mask_equals_create_block_mask(kv_end_BL, block_size):
    got = block_mask(kv_end_BL, block_size=block_size, device="cpu")
    assert_same_block_mask(got, tree_block_mask(kv_end_BL, block_size=block_size, device="cpu"))
    plan = block_plan(kv_end_BL, block_size)
    assert int(got.kv_num_blocks.sum()) == plan.num_partial
    assert int(got.full_kv_num_blocks.sum()) == plan.num_full


def test_direct_block_mask_flex_forward_matches_sdpa_cpu():
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(0)
    kv_end_BL = pad_kv_end([DOC_EXAMPLE * 1, [3, 3, 3, 5, 5]], 11)
    q, k, v = torch.randn(3, 2, 2, 11, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        out = flex_attention(q, k, v, block_mask=block_mask(kv_end_BL, block_size=4))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask(dense_mask(kv_end_BL)))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_end, match", [([1, 1], r"kv_end\[0, 1\] = 1"), ([3, 2], r"outside"),
                                           ([[]], "L > 0")])
def test_invalid_kv_end_is_refused(kv_end, match):
    with pytest.raises(ValueError, match=match):
        block_plan(kv_end, 2)


# --------------------------------------------------------------------------------------------
# Segment plan (the CPU path)


def flat_dense_mask(kv_end_BL):
    """The dense mask of rows flattened into one (rows are documents of one long row)."""
    return torch.block_diag(*dense_mask(kv_end_BL).int()).bool().numpy()


def test_docstring_example_segment_plan():
    plan = segment_plan(DOC_EXAMPLE, chunk=2)
    assert plan.seg_start_S.tolist() == [0, 4] and plan.seg_stop_S.tolist() == [4, 8]
    assert plan.keys(1).tolist() == [0, 1, 4, 5, 6, 7]  # ancestors h h, then its own positions
    assert plan.diag_runs_R3.tolist() == [[0, 2, 2], [4, 2, 2]] and plan.diag_buckets == ()
    # (segment, q0, q1, key stop) with first key rect_lo_R: t t x h h; r r r r x h h (its ancestors, once);
    # r r x r r (its own earlier chunk, a view of the row)
    assert plan.rect_R4.tolist() == [[0, 2, 4, 2], [1, 4, 8, 2], [1, 6, 8, 4]]
    assert plan.rect_lo_R.tolist() == [0, 0, 2]
    assert plan.visible_pairs == int(dense_mask(DOC_EXAMPLE).sum()) == 28
    assert plan.num_kernel_calls == 5


def test_scattered_ancestors():
    plan = segment_plan(SCATTERED, chunk=1)
    assert [plan.keys(i)[:plan.anc_ptr_S1[i + 1] - plan.anc_ptr_S1[i]].tolist() for i in range(4)] == [
        [], [0, 1], [0, 1, 3], [0, 1]]
    assert (plan_pairs_reference(plan) == dense_mask(SCATTERED).numpy()).all()


@FAST
@given(batch_st, st.sampled_from([1, 2, 3, 5, 128]))
def test_segment_plan_computes_each_visible_pair_once(kv_end_BL, chunk):
    plan = segment_plan(kv_end_BL, chunk=chunk)
    count = plan_pairs_reference(plan)
    assert count.max() <= 1
    assert (count.astype(bool) == flat_dense_mask(kv_end_BL)).all()
    assert plan.visible_pairs == int(dense_mask(kv_end_BL).sum())


@FAST
@given(batch_st, st.sampled_from([1, 2, 3, 128]))
def test_each_segment_gathers_its_ancestors_once(kv_end_BL, chunk):
    # without a window a rectangle is either a segment's ancestors for all its queries (one gather per
    # segment) or a chunk against its own segment's earlier positions (contiguous in the row: a view)
    plan = segment_plan(kv_end_BL, chunk=chunk)
    num_anc_S = np.diff(plan.anc_ptr_S1)
    seg_R, q0_R, q1_R, hi_R = plan.rect_R4.T
    ancestral_R = plan.rect_lo_R < num_anc_S[seg_R]
    assert (seg_R[ancestral_R] == np.flatnonzero(num_anc_S)).all()  # one each, in order
    assert (q0_R[ancestral_R] == plan.seg_start_S[seg_R[ancestral_R]]).all()
    assert (q1_R[ancestral_R] == plan.seg_stop_S[seg_R[ancestral_R]]).all()
    assert (hi_R[ancestral_R] == num_anc_S[seg_R[ancestral_R]]).all()
    for r in np.flatnonzero(~ancestral_R):
        keys = plan.keys(seg_R[r])[plan.rect_lo_R[r]:hi_R[r]]
        assert keys[0] == plan.seg_start_S[seg_R[r]] and (np.diff(keys) == 1).all() and keys[-1] < q0_R[r]


def test_padding_runs_as_one_batched_call():
    plan = segment_plan(pad_kv_end([[5, 5, 5, 5, 5]], 400), chunk=128)
    assert [b.shape for b in plan.diag_buckets] == [(395, 1), (1, 16)]  # pads; the document, padded
    assert plan.num_kernel_calls == 2 and len(plan.rect_R4) == 0


def test_non_tree_kv_end_is_refused():
    with pytest.raises(ValueError, match="not describe a tree"):
        segment_plan([3, 4, 4, 4])  # [0, 3) and [1, 4) overlap without nesting
    with pytest.raises(ValueError, match="outside"):
        segment_plan([2, 1])


# --------------------------------------------------------------------------------------------
# CUDA: flex attention with the direct BlockMask; the kernel visits exactly the plan's tiles


def _cuda_rows():
    layouts = [build_layout([V([1, 2, 3, 4] * 40, 60), V([1, 2, 3, 4] * 30 + [9] * 50, 130)]),
               build_layout([V(list(range(200)), 50)])]
    return pad_kv_end([concat(layouts).kv_end, layouts[1].kv_end], len(concat(layouts)) + 17)


@pytest.mark.requires_cuda
def test_direct_block_mask_on_cuda_equals_create_block_mask():
    kv_end_BL = torch.as_tensor(_cuda_rows(), device="cuda")
    assert_same_block_mask(block_mask(kv_end_BL, block_size=128),
                           tree_block_mask(kv_end_BL, block_size=128))


@pytest.mark.requires_cuda
def test_flex_with_direct_block_mask_matches_dense_on_cuda():
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(0)
    kv_end_BL = torch.as_tensor(_cuda_rows(), device="cuda")
    B, L = kv_end_BL.shape
    bm = block_mask(kv_end_BL, block_size=128)
    plan = block_plan(kv_end_BL, 128)
    computed = int(bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum())
    assert computed == plan.num_partial + plan.num_full < plan.kind_BMN.size
    q, k, v = (torch.randn(B, 2, L, 64, device="cuda", requires_grad=True) for _ in range(3))
    out = torch.compile(flex_attention)(q, k, v, block_mask=bm)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask(dense_mask(kv_end_BL)))
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
