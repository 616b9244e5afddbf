"""Hybrids are exact: recurrent layers scanned chain by chain equal N-pass (float64, <= 1e-9).

Qwen3.5 and Qwen3-Next (Gated DeltaNet), Nemotron-H, Granite-4-hybrid and Falcon-H1 (Mamba2), LFM2 (short
convolution): loss and every gradient under one-pass, k-pass:2 and packed rows with padding, against
the plain per-view forward. Float64 means float64 all the way (:func:`onepass.model.precision.float64_norms`
also makes the recurrent kernels' float32 casts float64, and Nemotron-H's ``lm_head(h).float()``,
:mod:`onepass.model.float64`). ``onepass verify --model DIR`` says EQUAL for the saved models.
"""

from __future__ import annotations

import json

import pytest
import torch

import onepass.mixers.tree as tree
from onepass.cli import main
from onepass.data.mathchat import load_sample
from onepass.model.float64 import float64_kernels
from onepass.model.couplings import recurrent_mixer
from onepass.model.precision import float64_norms
from onepass.render import render_views
from onepass.model.tiny import HYBRID_ARCHS, tiny_model
from onepass.verify.check import compact_vocab

from exactness import loss_and_grads, max_rel_diff, n_pass, tree_runs

TOL = 1e-9


@pytest.fixture(scope="module")
def conversations(qwen3_tokenizer):
    return compact_vocab([render_views(c, qwen3_tokenizer) for c in load_sample(limit=2)])


def exact_model(arch, vocab, backend):
    model = tiny_model(arch, vocab, dtype=torch.float64, attn_implementation=backend)
    float64_norms(model)
    return model


def rel_grad_diff(got, want):
    return max_rel_diff((1.0, got[1]), (1.0, want[1]))


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_hybrid_loss_and_every_gradient_equal_n_pass(conversations, one_thread, arch):
    views, vocab = conversations
    model = exact_model(arch, vocab, "sdpa")
    want = loss_and_grads(model, n_pass(model, views))
    for name, run in tree_runs(model, views, pack_k_pass=True, slack=8).items():
        got = loss_and_grads(model, run)
        loss_diff = abs(got[0] - want[0]) / abs(want[0])
        assert loss_diff <= TOL, f"{arch} {name} loss: {loss_diff:.2e}"
        assert rel_grad_diff(got, want) <= TOL, f"{arch} {name} gradients: {rel_grad_diff(got, want):.2e}"


@pytest.mark.parametrize("arch", ["lfm2", "qwen3.5", "nemotron-h", "falcon-h1"])
def test_scanning_the_whole_row_differs(conversations, one_thread, monkeypatch, arch):
    """The tests can fail: mixers given a single chain per row (the row as one sequence) differ."""
    views, vocab = conversations
    model = exact_model(arch, vocab, "sdpa")
    want = loss_and_grads(model, n_pass(model, views))
    monkeypatch.setattr(tree, "batch_chains", lambda kv: tuple(
        (tree.Chain(start=0, end=len(row), parent=-1, depth=0),) for row in kv))
    got = loss_and_grads(model, tree_runs(model, views, pack_k_pass=True, slack=8)["one-pass"])
    assert rel_grad_diff(got, want) > 1e-7


def test_float64_kernels_agree_with_the_originals_in_float32():
    """The float64 copies are the kernels' own code: on float32 inputs the dispatcher runs the original,
    on float64 inputs the copy, which agrees with the original to float32 precision."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as mod

    recurrent_mixer(mod.Qwen3_5GatedDeltaNet)  # a release before the cache API refuses first (conftest)
    assert float64_kernels([mod.Qwen3_5GatedDeltaNet]) >= 1  # found in the mixer's source, not named
    fn = mod.torch_chunk_gated_delta_rule
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 20, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    g, beta = -torch.rand(1, 20, 2, generator=gen, dtype=torch.float64), torch.rand(1, 20, 2, generator=gen,
                                                                                    dtype=torch.float64)
    exact, _ = fn(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    rounded, _ = fn.__wrapped__(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert exact.dtype == torch.float64 and rounded.dtype == torch.float64
    assert torch.allclose(exact, rounded, rtol=1e-5, atol=1e-6) and not torch.equal(exact, rounded)
    got32, _ = fn(q.float(), k.float(), v.float(), g.float(), beta.float(), use_qk_l2norm_in_kernel=True)
    want32, _ = fn.__wrapped__(q.float(), k.float(), v.float(), g.float(), beta.float(),
                               use_qk_l2norm_in_kernel=True)
    assert torch.equal(got32, want32)


def test_float64_head_of_nemotron_h_keeps_float64_logits():
    """Nemotron-H's ``lm_head(h).float()`` rounds float64 logits to float32; the float64 copy of its
    forward does not, and agrees with the original to float32 precision."""
    from onepass.model.float64 import float64_mixers

    model = tiny_model("nemotron-h", 50, dtype=torch.float64)
    ids = torch.arange(10)[None]
    with torch.no_grad():
        want = model(input_ids=ids).logits
        assert float64_mixers(model) >= 1
        got = model(input_ids=ids).logits
    assert want.dtype == torch.float32 and got.dtype == torch.float64
    assert torch.allclose(got, want.double(), rtol=1e-5, atol=1e-6)


def test_a_mixer_without_the_plan_runs_unchanged(conversations):
    """The plain forward (the N-pass reference, generation) is the model's own."""
    _, vocab = conversations
    model = tiny_model("lfm2", vocab, dtype=torch.float64)
    ids = torch.arange(12)[None] % vocab
    with torch.no_grad():
        want = model(input_ids=ids).logits
        assert tree.install(model) == 1 and tree.install(model) == 1  # idempotent
        assert torch.equal(model(input_ids=ids).logits, want)
        tree.uninstall(model)
    assert not any(tree._WRAPPED in m.__dict__ for m in model.modules())


CHAT = {"messages": [{"role": "user", "content": "2+2?"},
                     {"role": "assistant", "content": "4", "reasoning_content": "add"},
                     {"role": "user", "content": "and 3+3?"},
                     {"role": "assistant", "content": "6", "reasoning_content": "add again"}]}


@pytest.mark.slow  # saves six models with the real 151k vocabulary (~4 s of CPU each)
@pytest.mark.parametrize("arch", ["qwen3.5", "qwen3-next", "nemotron-h", "lfm2",
                                  "deepseek-v3", "glm4-moe"])  # the MoEs: routers kept float32 since 5.24
def test_verify_says_equal_for_a_saved_hybrid(arch, tmp_path, qwen3_tokenizer, one_thread, capsys, monkeypatch):
    """As a user runs it: a saved model with the real vocabulary, ``onepass verify --model DIR`` in float64
    (Nemotron-H's head rounds float64 logits to float32 unless :mod:`onepass.model.float64` fixes it)."""
    monkeypatch.setenv("ONEPASS_DEBUG", "1")  # an older release's refusal raises (conftest.promised_refusal)
    tiny_model(arch, len(qwen3_tokenizer), tie_word_embeddings=True).save_pretrained(str(tmp_path / arch))
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps(CHAT) + "\n")
    code = main(["verify", "--data", str(data), "--model", str(tmp_path / arch), "--dtype", "float64"])
    out = capsys.readouterr().out.strip().splitlines()
    last = json.loads(out[-1])
    assert code == 0 and last["equal"] and "-> EQUAL" in out[-2], out[-2]
    assert last["rel_loss_diff"] <= TOL and last["max_rel_grad_diff"] <= TOL
