"""The CPU tree backend against dense SDPA: its plan, its outputs and gradients, and HF models end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import onepass.attention.cpu as cpu
import onepass.attention.cpu_tiles as cpu_tiles
import onepass.loss
from onepass.attention.segments import segment_plan
from onepass.attention.cpu import cpu_attention_mask, register
from onepass.attention.cpu_tiles import CpuAttentionError, tree_attention, tree_attention_reference
from onepass.attention.mask import dense_mask, pad_kv_end
from onepass.layout.tree import build_layout, concat

from strategies import DOC_EXAMPLE, SCATTERED, V, batch_strategy  # noqa: E402

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOL = 1e-9

batch_st = batch_strategy(6)


def random_qkv(B, L, *, heads=4, kv_heads=2, dim=8, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, heads, L, dim), (B, kv_heads, L, dim), (B, kv_heads, L, dim)]
    return [torch.randn(s, generator=gen, dtype=dtype).requires_grad_() for s in shapes]


def assert_matches_dense(kv_end_BL, *, tol=TOL, scale=None, chunk=128, **kw):
    kv_end_BL = np.asarray(kv_end_BL).reshape(-1, np.shape(kv_end_BL)[-1])
    q, k, v = random_qkv(*kv_end_BL.shape, **kw)
    out = tree_attention(q, k, v, segment_plan(kv_end_BL, chunk=chunk), scale=scale)
    ref = tree_attention_reference(q, k, v, kv_end_BL, scale=scale)
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


# --------------------------------------------------------------------------------------------
# outputs and gradients against dense SDPA (float64)


@pytest.mark.parametrize("chunk", [2, 128])
def test_docstring_example_attention(chunk):
    assert_matches_dense(DOC_EXAMPLE, chunk=chunk)


def test_scattered_ancestors_attention():
    assert_matches_dense(SCATTERED, chunk=2)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch_st, st.sampled_from([(4, 2), (2, 2), (6, 1)]), st.sampled_from([1, 3, 16, 128]))
def test_tree_attention_equals_dense_sdpa(kv_end_BL, heads, chunk):
    assert_matches_dense(kv_end_BL, heads=heads[0], kv_heads=heads[1], chunk=chunk)


@pytest.mark.parametrize("chunk", [16, 32, 128])
def test_long_segments_scale_and_chunks(chunk):
    # segments of several chunks with a ragged last one, ancestors, padding, a custom scale
    a = build_layout([V(list(range(90)), 30), V(list(range(60)) + list(range(100, 170)), 70),
                      V(list(range(60)) + list(range(200, 230)), 60)])
    b = build_layout([V(list(range(40)), 1)])
    kv_end_BL = pad_kv_end([concat([a, b]).kv_end, b.kv_end], len(a) + len(b) + 5)
    plan = segment_plan(kv_end_BL, chunk=chunk)
    longest = int((plan.seg_stop_S - plan.seg_start_S).max())  # 0..59 then its heaviest branch 100..169
    assert len(plan.diag_buckets) and len(plan.rect_R4) and (len(plan.diag_runs_R3) > 0) == (chunk <= longest)
    assert_matches_dense(kv_end_BL, scale=0.3, dim=16, chunk=chunk)


def test_without_native_grouped_query_heads(monkeypatch):
    # an older torch's kernel: key/value heads are repeated once for the row, gradients summed back
    monkeypatch.setattr(cpu_tiles, "native_gqa", lambda: False)
    assert_matches_dense(pad_kv_end([SCATTERED, DOC_EXAMPLE], 9), chunk=2)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_low_precision_close(dtype, tol):
    assert_matches_dense(pad_kv_end([SCATTERED, DOC_EXAMPLE], 9), dtype=dtype, tol=tol)


def test_shape_mismatch_is_refused():
    q, k, v = random_qkv(1, 8)
    with pytest.raises(CpuAttentionError, match="cannot serve"):
        tree_attention(q, k, v, segment_plan([7] * 7))
    with pytest.raises(CpuAttentionError, match="share"):
        tree_attention(q, k[:, :1].repeat(1, 3, 1, 1), v[:, :1].repeat(1, 3, 1, 1), DOC_EXAMPLE)


# --------------------------------------------------------------------------------------------
# HF models end to end


@pytest.fixture(scope="module")
def conversations(qwen3_tokenizer):
    from onepass.data.mathchat import load_sample
    from onepass.render import render_views
    from onepass.verify.check import compact_vocab

    return compact_vocab([render_views(c, qwen3_tokenizer) for c in load_sample(limit=2)])


def exact_model(arch, vocab):
    from onepass.model.precision import float64_norms
    from onepass.model.tiny import tiny_model

    model = tiny_model(arch, vocab, dtype=torch.float64, attn_implementation=register())
    assert float64_norms(model)[0] > 0
    return model


@pytest.fixture
def onepass_cpu_masks(monkeypatch):
    """onepass.loss builds the onepass_cpu mask (what attention.py will do once it knows the backend)."""
    monkeypatch.setattr(onepass.loss, "attention_mask_for",
                        lambda model, kv_end_BL, **kw: cpu_attention_mask(kv_end_BL))


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_verify_one_pass_equals_n_pass(conversations, onepass_cpu_masks, arch):
    from onepass.verify.check import run_verify

    views, vocab = conversations
    report = run_verify(views, exact_model(arch, vocab), schedule="one-pass")
    assert report.one_pass_tokens < report.n_pass_tokens
    assert report.rel_loss_diff <= TOL and report.max_rel_grad_diff <= TOL


def test_packed_padded_batch_matches_sdpa_model(conversations):
    from onepass.loss import layouts_to_batch
    from onepass.attention.mask import sdpa_mask
    from onepass.layout.pack import pack_layouts
    from onepass.layout.schedule import parse_schedule, schedule_views

    views, vocab = conversations
    layouts = [x for vs in views for x in schedule_views(vs, parse_schedule("one-pass")).layouts]
    batch = layouts_to_batch(pack_layouts(layouts, max(map(len, layouts)) + 40))
    assert batch["kv_end"].shape[0] >= 2
    model = exact_model("qwen3", vocab)
    outs = []
    for mask in (cpu_attention_mask(batch["kv_end"]), sdpa_mask(dense_mask(batch["kv_end"]))):
        # a 4-D bool mask is not ours: the backend is plain sdpa for it (the reference)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       attention_mask=mask, use_cache=False).logits
        grads = torch.autograd.grad(logits.square().mean(), list(model.parameters()))
        outs.append((logits, grads))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=TOL, rtol=TOL)
    for got, want in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)


def test_plan_is_built_once_per_batch(monkeypatch):
    calls = []
    real = cpu.segment_plan
    monkeypatch.setattr(cpu, "segment_plan", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model = exact_model("qwen3", 20)  # two layers
    mask = cpu_attention_mask(torch.as_tensor([DOC_EXAMPLE]))
    model(input_ids=torch.arange(8)[None], position_ids=torch.tensor([[0, 1, 2, 3, 2, 3, 4, 5]]),
          attention_mask=mask)
    assert len(calls) == 1
    bare = mask.clone()  # the same kv_end without the plan attached: built on first use, then reused
    model(input_ids=torch.arange(8)[None], position_ids=torch.tensor([[0, 1, 2, 3, 2, 3, 4, 5]]),
          attention_mask=bare)
    assert len(calls) == 2


def test_tiles_are_built_once_per_plan_and_shared_by_every_layer(monkeypatch):
    calls = []
    real = cpu_tiles._build_tiles
    monkeypatch.setattr(cpu_tiles, "_build_tiles", lambda plan: calls.append(plan) or real(plan))
    plan = segment_plan(np.asarray([SCATTERED, [2, 2, 7, 7, 7, 7, 7]]), chunk=2)  # buckets, runs, rectangles
    q, k, v = random_qkv(2, 7)
    outs = [tree_attention(q, k, v, plan) for _ in range(3)]  # three layers, one plan
    torch.autograd.grad(sum(o.sum() for o in outs), (q, k, v))
    assert calls == [plan]
    tiles, fresh = cpu_tiles._tiles_of(plan), real(plan)  # the cached tiles are the plan's own
    assert tiles.runs == fresh.runs and len(tiles.buckets) == len(fresh.buckets) > 0
    for got, want in zip(tiles.buckets, fresh.buckets):
        for a, b in zip(got, want):
            assert (a is None and b is None) or torch.equal(a, b)
    assert [(q0, q1) for q0, q1, _ in tiles.rects] == [(q0, q1) for q0, q1, _ in fresh.rects]
    for (*_, got), (*_, want) in zip(tiles.rects, fresh.rects):
        assert got == want if isinstance(want, tuple) else torch.equal(got, want)
    other = segment_plan(DOC_EXAMPLE, chunk=2)  # another plan gets its own tiles
    tree_attention(*random_qkv(1, 8), other)
    assert calls == [plan, other] and cpu_tiles._tiles_of(other) is not tiles


def test_unsupported_arguments_are_refused():
    q, k, v = random_qkv(1, 8)
    module = torch.nn.Module()
    mask = cpu_attention_mask(torch.as_tensor([DOC_EXAMPLE]))
    for kwargs, name in [({"dropout": 0.1}, "dropout"), ({"softcap": 30.0}, "softcap"),
                         ({"sliding_window": 4}, "sliding_window")]:
        with pytest.raises(CpuAttentionError, match=name):
            cpu.onepass_cpu_attention(module, q, k, v, mask, **kwargs)
    out, weights = cpu.onepass_cpu_attention(module, q, k, v, mask, scaling=0.5)
    assert weights is None and out.shape == (1, 8, 4, 8)  # [B, L, H, D]
