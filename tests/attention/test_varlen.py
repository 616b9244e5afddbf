"""``onepass_varlen``: tree rows as one call of torch's flash varlen kernel, each segment against its gathered
root path, causal at the bottom right.

On CPU: the gather plan computes exactly the tree mask (with and without windows, any depth-first order,
padding), the CPU kernel equals dense SDPA under the tree mask (outputs and gradients, float64, grouped-query
heads, windows), the transformers glue equals sdpa on one-pass and N-pass rows, what it cannot do is refused
in one line, and ``onepass verify --attn onepass_varlen`` is EQUAL in float64 on dense, GQA, windowed and
shared-prefix rows. On CUDA: the real kernel against the CPU reference on the same plan (the bottom-right
alignment), and a training loss against sdpa.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onepass.attention.cpu_tiles import tree_attention_reference
from onepass.attention.gather import gather_plan, plan_mask_reference
from onepass.attention.mask import dense_mask, pad_kv_end
from onepass.attention.varlen import (
    VarlenError,
    bottom_right_mask,
    onepass_varlen_attention,
    varlen_attention,
    varlen_attention_mask,
    varlen_attention_reference,
)
from onepass.layout.flops import visible_pairs
from onepass.layout.tree import build_layout, concat

from strategies import SCATTERED, V, batch_strategy, layout_st  # noqa: E402

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOL = 1e-9


@st.composite
def rows_st(draw, max_extra_pad=4):
    """(kv_end [B, L], position_ids [B, L]) of packed, padded rows of random trees (pads: position 0)."""
    rows = [concat(draw(st.lists(layout_st, min_size=1, max_size=3))) for _ in range(draw(st.integers(1, 3)))]
    L = max(map(len, rows)) + draw(st.integers(0, max_extra_pad))
    pos_BL = np.zeros((len(rows), L), dtype=np.int64)
    for b, row in enumerate(rows):
        pos_BL[b, :len(row)] = row.position_ids
    return pad_kv_end([r.kv_end for r in rows], L), pos_BL


# --------------------------------------------------------------------------------------------
# the plan (numpy): exactly the tree mask


def test_the_plan_by_hand():
    # SCATTERED: segments h a b | d d2 | d3 | f, with ancestors -, h a, h a d, h a
    plan = gather_plan(SCATTERED)
    assert plan.key_index.tolist() == [0, 1, 2, 0, 1, 3, 4, 0, 1, 3, 5, 0, 1, 6]
    assert plan.cu_seqlens_q.tolist() == [0, 3, 5, 6, 7] and plan.cu_seqlens_k.tolist() == [0, 3, 7, 11, 14]
    assert (plan.max_q, plan.max_k) == (3, 4) and plan.cu_seqlens_q.dtype == np.int32
    assert bottom_right_mask(2, 4).int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]  # d, d2 against h a d d2
    # window 2 (positions = depths): each segment keeps its last ancestor only
    windowed = gather_plan(SCATTERED, position_ids=[0, 1, 2, 2, 3, 3, 2], window=2)
    assert windowed.key_index.tolist() == [0, 1, 2, 1, 3, 4, 3, 5, 1, 6]


def test_rows_that_never_branch_are_documents_without_a_gather():
    # row 0: a 3-token view, a 2-token view, one pad; row 1: a 4-token view, two pads
    plan = gather_plan([[3, 3, 3, 5, 5, 6], [4, 4, 4, 4, 5, 6]])
    assert plan.key_index is None and plan.max_q == plan.max_k == 4
    assert plan.cu_seqlens_q.tolist() == plan.cu_seqlens_k.tolist() == [0, 3, 5, 6, 10, 11, 12]


@FAST
@given(batch_strategy(max_extra_pad=4))
def test_the_gather_plan_computes_exactly_the_tree_mask(kv_end_BL):
    plan = gather_plan(kv_end_BL)
    B, L = kv_end_BL.shape
    want = dense_mask(kv_end_BL).numpy()
    got = plan_mask_reference(plan).reshape(B, L, B, L)
    assert (got[np.arange(B), :, np.arange(B), :] == want).all()  # each row's own block: the tree mask
    assert got.sum() == want.sum() == plan.visible_pairs  # and nothing across rows
    assert plan.visible_pairs == sum(visible_pairs(row) for row in kv_end_BL)


@FAST
@given(rows_st(), st.sampled_from([1, 2, 3, 5, 64]))
def test_the_windowed_gather_plan_computes_exactly_the_windowed_mask(rows, window):
    kv_end_BL, pos_BL = rows
    plan = gather_plan(kv_end_BL, position_ids=pos_BL, window=window)
    B, L = kv_end_BL.shape
    got = plan_mask_reference(plan).reshape(B, L, B, L)
    want = dense_mask(kv_end_BL, position_ids=pos_BL, window=window).numpy()
    assert (got[np.arange(B), :, np.arange(B), :] == want).all() and got.sum() == want.sum() == plan.visible_pairs


def test_a_window_needs_positions_that_count_the_depth():
    with pytest.raises(ValueError, match="not its parent's"):
        gather_plan(SCATTERED, position_ids=[0, 1, 2, 9, 3, 3, 2], window=2)
    with pytest.raises(ValueError, match="does not describe a tree"):
        gather_plan([[2, 1]])


# --------------------------------------------------------------------------------------------
# the CPU kernel and the transformers glue (float64)


def random_qkv(B, L, *, heads=4, kv_heads=2, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64).requires_grad_()
            for s in ((B, heads, L, dim), (B, kv_heads, L, dim), (B, kv_heads, L, dim))]


def through_varlen(q, k, v, mask, scale=None):
    B, H, L, D = q.shape
    flat = [t.transpose(1, 2).reshape(B * L, t.shape[1], D) for t in (q, k, v)]
    out = varlen_attention(*flat, getattr(mask, "onepass_varlen_plan"), scale=scale)
    return out.reshape(B, L, H, D).transpose(1, 2)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows_st(), st.sampled_from([None, 1, 3, 8]), st.sampled_from([(4, 2), (2, 2), (6, 1)]))
def test_the_cpu_kernel_equals_dense_attention_under_the_tree_mask(rows, window, heads):
    kv_end_BL, pos_BL = rows
    q, k, v = random_qkv(*kv_end_BL.shape, heads=heads[0], kv_heads=heads[1])
    mask = varlen_attention_mask(kv_end_BL, position_ids=pos_BL, window=window)
    out = through_varlen(q, k, v, mask, scale=0.3)
    ref = tree_attention_reference(q, k, v, kv_end_BL, scale=0.3, position_ids=pos_BL, window=window)
    torch.testing.assert_close(out, ref, atol=TOL, rtol=TOL)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)  # the gather's backward: an index-add


def _tree_batch(vocab: int, seed: int = 0, one_pass: bool = True):
    """A [2, L] batch as layouts_to_batch makes it: one-pass trees of views sharing prefixes (or the same
    views as N-pass rows), packed, padded."""
    from onepass.layout.view import View
    from onepass.loss import layouts_to_batch

    rng = np.random.default_rng(seed)
    head = rng.integers(0, vocab, 12)

    def conv(n):
        parts = [rng.integers(0, vocab, 6) for _ in range(n)]
        return [View(tokens=np.concatenate([head, *parts[:t + 1]]), num_prompt=12 + 6 * t + 2, turn=t)
                for t in range(n)]

    convs = [conv(3), conv(2), conv(4)]
    if one_pass:
        rows = [concat([build_layout(convs[0]), build_layout(convs[1])]), build_layout(convs[2])]
    else:
        rows = [concat([build_layout([v]) for v in convs[0] + convs[1]]), concat([build_layout([v]) for v in convs[2]])]
    return layouts_to_batch(rows)


@pytest.mark.parametrize("arch,one_pass", [("qwen3", True), ("qwen3", False), ("mistral-window", True),
                                           ("qwen3-window", True)])
def test_the_transformers_glue_equals_sdpa_with_the_tree_mask(arch, one_pass):
    """Tiny models with grouped-query heads (4 query heads, 2 key/value heads), windowed layers among them:
    loss and gradients through onepass_varlen (its CPU kernel) equal sdpa's on tree rows and N-pass rows."""
    from onepass.attention.varlen import register
    from onepass.loss import batch_loss
    from onepass.model.tiny import tiny_model

    register()
    batch = _tree_batch(50, one_pass=one_pass)
    losses, grads = [], []
    for backend in ("onepass_varlen", "sdpa"):
        model = tiny_model(arch, 50, dtype=torch.float64, attn_implementation=backend).train()
        loss = batch_loss(model, batch)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert losses[0] == pytest.approx(losses[1], rel=1e-12)
    for name, g in grads[1].items():
        torch.testing.assert_close(grads[0][name], g, rtol=1e-10, atol=1e-12)


def test_what_it_cannot_do_exactly_is_refused_in_one_line():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(VarlenError, match="needs the mask of onepass.attention.varlen.varlen_attention_mask cut for"):
        onepass_varlen_attention(torch.nn.Module(), q, q, q, torch.tensor([[[[4, 4, 4, 4]]]]), sliding_window=2)
    r = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(0))
    kv_end_alone = onepass_varlen_attention(torch.nn.Module(), r, r, r, torch.tensor([[[[2, 2, 4, 4]]]]))[0]
    assert torch.equal(kv_end_alone, onepass_varlen_attention(
        torch.nn.Module(), r, r, r, varlen_attention_mask([[2, 2, 4, 4]]))[0])  # its plan rebuilt from it
    mask = varlen_attention_mask(torch.tensor([[4, 4, 4, 4]]))
    with pytest.raises(VarlenError, match=r"cannot train attention sinks .*use flex_attention on CUDA or "
                                          r"onepass_cpu on CPU$"):
        onepass_varlen_attention(torch.nn.Module(), q, q, q, mask, s_aux=torch.zeros(2))
    with pytest.raises(VarlenError, match="does not implement softcap=30.0"):
        onepass_varlen_attention(torch.nn.Module(), q, q, q, mask, softcap=30.0)
    with pytest.raises(VarlenError, match="has sliding_window=8 but its onepass_varlen mask was built for window=None"):
        onepass_varlen_attention(torch.nn.Module(), q, q, q, mask, sliding_window=8)


def test_a_model_with_attention_sinks_is_refused_in_one_line():
    from onepass.attention.varlen import register
    from onepass.loss import batch_loss
    from onepass.model.tiny import tiny_model

    register()
    model = tiny_model("gpt-oss", 50, dtype=torch.float64, attn_implementation="onepass_varlen")
    with pytest.raises(VarlenError, match="cannot train attention sinks"):
        batch_loss(model, _tree_batch(50))


SMALL_AGENTS = dict(harnesses=2, prompt=(60, 75), tools=2, min_turns=1, max_turns=2, user=(2, 6), reasoning=(2, 5),
                    tool_result=(2, 6), answer=(1, 4), calls=(0, 1))  # tests/test_share_exactness.py's


@pytest.mark.parametrize("extra", [["--tiny", "qwen3"], ["--tiny", "mistral-window"], ["--tiny", "qwen3", "--pack"]],
                         ids=["dense-gqa", "windowed", "shared-prefix-rows"])
def test_verify_with_onepass_varlen_is_equal_in_float64_on_cpu(extra, capsys, tmp_path):
    """``onepass verify --attn onepass_varlen`` (float64, CPU: the gather plan on its CPU kernel). The tiny
    Qwen3 has grouped-query heads (4 / 2); mistral-window windows every layer (16 positions); with --pack,
    agent conversations of two harnesses share their system prompt and tools across conversations."""
    from onepass.cli import main
    from onepass.data.synthetic import AgentConfig, agent_record

    data = "builtin:mathchat"
    if "--pack" in extra:
        data = str(tmp_path / "agent.jsonl")
        (tmp_path / "agent.jsonl").write_text("".join(json.dumps(agent_record(i, 7, AgentConfig(**SMALL_AGENTS)))
                                                      + "\n" for i in range(4)), encoding="utf-8")
    limit = "4" if "--pack" in extra else "2"
    assert main(["verify", "--data", data, "--tokenizer", "builtin:qwen3", "--limit", limit, "--dtype", "float64",
                 "--attn", "onepass_varlen", *extra]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["equal"] and result["attention"] == "onepass_varlen" and result["one_pass_tokens"] > 0
    assert result["rel_loss_diff"] <= 1e-9 and result["max_rel_grad_diff"] <= 1e-9
    if "--pack" in extra:
        assert result["shared"] and result["row_tokens"] < result["one_pass_tokens"]


# --------------------------------------------------------------------------------------------
# CUDA: the real kernel


@pytest.mark.requires_cuda
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernel_aligns_causal_at_the_bottom_right_on_cuda(dtype, window):
    """Tree rows (segments with ancestors: queries shorter than keys) through torch's flash varlen kernel
    against the CPU reference on the same plan and inputs, in float32: forward and gradients."""
    rng = np.random.default_rng(0)
    head = list(rng.integers(0, 9, 300))
    views = [V(head + list(rng.integers(0, 9, n)), 300) for n in (200, 129, 64, 7)]
    row = concat([build_layout(views), build_layout([V(list(range(90)), 1)])])
    kv_end_BL, pos_BL = pad_kv_end([row.kv_end], len(row) + 9), np.zeros((1, len(row) + 9), dtype=np.int64)
    pos_BL[0, :len(row)] = row.position_ids
    B, L = kv_end_BL.shape
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B * L, h, 128, generator=gen, dtype=torch.float32) for h in (8, 2, 2))
    q, k, v = (t.to(dtype).float() for t in (q, k, v))  # the same numbers on both sides
    mask = varlen_attention_mask(kv_end_BL, position_ids=pos_BL, window=window, device="cuda")
    plan = getattr(mask, "onepass_varlen_plan")
    assert plan.key_index is not None and plan.plan.max_k > plan.plan.max_q  # queries shorter than keys
    qc, kc, vc = (t.cuda().to(dtype).requires_grad_() for t in (q, k, v))
    out = varlen_attention(qc, kc, vc, plan, scale=0.1)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = varlen_attention_reference(qr, kr.index_select(0, plan.key_index.cpu()),
                                     vr.index_select(0, plan.key_index.cpu()), plan.plan.cu_seqlens_q,
                                     plan.plan.cu_seqlens_k, scale=0.1, window=window)
    torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)
    g = torch.randn(ref.shape, generator=gen).to(dtype)
    got = torch.autograd.grad(out, (qc, kc, vc), g.cuda())
    want = torch.autograd.grad(ref, (qr, kr, vr), g.float())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float().cpu(), b, atol=5e-2, rtol=5e-2)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("one_pass", [True, False])
def test_varlen_training_loss_equals_sdpa_on_cuda(one_pass):
    from onepass.attention.varlen import register
    from onepass.loss import batch_loss
    from onepass.model.tiny import tiny_model

    register()
    batch = {k: v.cuda() for k, v in _tree_batch(50, one_pass=one_pass).items()}
    losses = []
    for backend in ("onepass_varlen", "sdpa"):
        model = tiny_model("qwen3", 50, dtype=torch.bfloat16, attn_implementation=backend, device="cuda",
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64).train()
        losses.append(batch_loss(model, batch).item())
    assert losses[0] == pytest.approx(losses[1], rel=2e-2)

