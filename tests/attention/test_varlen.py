"""``onepass_varlen``: N-pass packed rows through torch's flash varlen kernel (the bench's FA2-class baseline).

On CPU: the documents cut from ``kv_end`` give exactly the tree mask (causal inside each document), a
row that branches is refused in one line, and the transformers glue (shapes, grouped-query heads, the
mask passed through) is checked with the kernel replaced by a per-document SDPA reference. On CUDA:
the real kernel against SDPA with the dense mask, forward and gradients, and one training loss.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onepass.attention.mask import dense_mask, pad_kv_end, sdpa_mask
from onepass.attention.varlen import VarlenError, documents, varlen_attention_mask
from onepass.layout.tree import build_layout, concat

from strategies import SCATTERED, random_views  # noqa: E402

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def n_pass_rows(spec):
    """kv_end [B, L] of N-pass packed rows (each view its own chain), padded to a common length + extra."""
    rows, extra = spec
    kv = [concat([build_layout([v]) for v in views]).kv_end for views in rows]
    return pad_kv_end(kv, max(len(k) for k in kv) + extra)


n_pass_st = st.tuples(st.lists(random_views(10), min_size=1, max_size=3), st.integers(0, 5)).map(n_pass_rows)


def causal_documents_mask(cu_seqlens: np.ndarray, B: int, L: int) -> np.ndarray:
    """What the varlen kernel computes, as a [B, L, L] mask: causal inside each document, nothing across."""
    doc = np.zeros(B * L, dtype=np.int64)
    doc[cu_seqlens[1:-1]] = 1
    doc = np.cumsum(doc).reshape(B, L)
    idx = np.arange(L)
    return (doc[:, :, None] == doc[:, None, :]) & (idx[None, None, :] <= idx[None, :, None])


@FAST
@given(n_pass_st)
def test_documents_give_exactly_the_tree_mask_of_n_pass_rows(kv_end_BL):
    docs = documents(kv_end_BL)
    B, L = kv_end_BL.shape
    assert docs.cu_seqlens[0] == 0 and docs.cu_seqlens[-1] == B * L and docs.cu_seqlens.dtype == np.int32
    assert docs.max_len == np.diff(docs.cu_seqlens).max()
    np.testing.assert_array_equal(causal_documents_mask(docs.cu_seqlens, B, L), dense_mask(kv_end_BL).numpy())


def test_documents_by_hand():
    # row 0: a 3-token view, a 2-token view, one pad; row 1: a 4-token view, two pads
    docs = documents([[3, 3, 3, 5, 5, 6], [4, 4, 4, 4, 5, 6]])
    assert docs.cu_seqlens.tolist() == [0, 3, 5, 6, 10, 11, 12] and docs.max_len == 4


def test_a_row_that_branches_is_refused_in_one_line():
    with pytest.raises(VarlenError, match=r"^onepass_varlen: row 1 is a tree that branches .*flex_attention"):
        documents(pad_kv_end([[2, 2], SCATTERED], 7))
    with pytest.raises(ValueError, match="does not describe a tree"):
        documents([[2, 1]])


def per_document_reference(query, key, value, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                           return_aux=None):
    """torch.nn.attention.varlen.varlen_attn's contract on CPU: [T, H, D], causal per document, GQA."""
    assert window_size == (-1, 0) and torch.equal(cu_q, cu_k) and max_q == max_k
    assert int(torch.diff(cu_q).max()) == max_q
    out = []
    for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        q, k, v = (t[s:e].transpose(0, 1)[None] for t in (query, key, value))
        out.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                    enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(out)


def _n_pass_batch(vocab: int, seed: int = 0):
    """A [2, L] batch of N-pass packed rows (with padding) of random views, as layouts_to_batch makes it."""
    from onepass.loss import layouts_to_batch
    from onepass.layout.view import View

    rng = np.random.default_rng(seed)
    views = [View(tokens=rng.integers(0, vocab, n), num_prompt=n // 3, turn=0) for n in (9, 14, 5, 20, 7)]
    rows = [concat([build_layout([v]) for v in views[:3]]), concat([build_layout([v]) for v in views[3:]])]
    return layouts_to_batch(rows)


def test_the_transformers_glue_equals_sdpa_with_the_tree_mask(monkeypatch):
    """A tiny Qwen3 with grouped-query heads (4 query heads, 2 key/value heads) on N-pass packed rows: loss and
    gradients through onepass_varlen (kernel replaced by its per-document reference) equal SDPA's."""
    import torch.nn.attention.varlen as torch_varlen

    from onepass.attention.varlen import register
    from onepass.loss import batch_loss
    from onepass.model.tiny import tiny_model

    monkeypatch.setattr(torch_varlen, "varlen_attn", per_document_reference)
    register()
    batch = _n_pass_batch(50)
    losses, grads = [], []
    for backend in ("onepass_varlen", "sdpa"):
        model = tiny_model("qwen3", 50, dtype=torch.float64, attn_implementation=backend,
                           num_attention_heads=4, num_key_value_heads=2).train()
        loss = batch_loss(model, batch)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert losses[0] == pytest.approx(losses[1], rel=1e-12)
    for name, g in grads[1].items():
        torch.testing.assert_close(grads[0][name], g, rtol=1e-10, atol=1e-12)


def test_a_mask_of_another_backend_is_refused_in_one_line():
    from onepass.attention.varlen import onepass_varlen_attention

    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(VarlenError, match="needs the mask of onepass.attention.varlen.varlen_attention_mask"):
        onepass_varlen_attention(torch.nn.Module(), q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool))
    mask = varlen_attention_mask(torch.tensor([[4, 4, 4, 4]]))
    with pytest.raises(VarlenError, match="does not implement sliding_window=8"):
        onepass_varlen_attention(torch.nn.Module(), q, q, q, mask, sliding_window=8)


# ---------------------------------------------------------------------------------------------
# CUDA: the real kernel


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_kernel_equals_sdpa_with_the_dense_mask_on_cuda(dtype):
    from onepass.attention.varlen import onepass_varlen_attention

    torch.manual_seed(0)
    kv_end_BL = torch.as_tensor(pad_kv_end([concat([build_layout([V]) for V in vs]).kv_end for vs in (
        [_view(300), _view(129), _view(64)], [_view(500)])], 520), device="cuda")
    B, L = kv_end_BL.shape
    q = torch.randn(B, 8, L, 128, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, 2, L, 128, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    out, _ = onepass_varlen_attention(torch.nn.Module(), q, k, v, varlen_attention_mask(kv_end_BL), scaling=0.1)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask(dense_mask(kv_end_BL)),
                                                           scale=0.1, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)


@pytest.mark.requires_cuda
def test_varlen_training_loss_equals_sdpa_on_cuda():
    from onepass.attention.varlen import register
    from onepass.loss import batch_loss
    from onepass.model.tiny import tiny_model

    register()
    batch = {k: v.cuda() for k, v in _n_pass_batch(50).items()}
    losses = []
    for backend in ("onepass_varlen", "sdpa"):
        model = tiny_model("qwen3", 50, dtype=torch.bfloat16, attn_implementation=backend, device="cuda",
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64).train()
        losses.append(batch_loss(model, batch).item())
    assert losses[0] == pytest.approx(losses[1], rel=2e-2)


def _view(n: int):
    from onepass.layout.view import View

    return View(tokens=np.arange(n) % 7, num_prompt=n // 2, turn=0)
