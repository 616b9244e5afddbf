"""Every architecture onepass calls exact: loss and every gradient equal N-pass (float64, <= 1e-9).

The matrix: the dense six, Mistral with its window on, Qwen3 with
``use_sliding_window``, gpt-oss (alternating windows, attention sinks, MoE),
OLMo-3, Gemma 3 (text), DeepSeek-V3 (latent attention, MoE) and GLM-4-MoE,
each as a tiny random twin (:mod:`onepass.model.tiny`, windows of 8-16 positions so
they cut through the history of every conversation here), under one-pass,
k-pass:2 and packed rows with padding, on every CPU backend the model
supports (the hybrids, with recurrent layers: tests/mixers). The reference is the plain per-view HF forward
(:func:`onepass.loss.view_loss_reference`) of a model that never sees
onepass's masks: sdpa, or eager for gpt-oss (it refuses sdpa; its eager
softmax is float64).
"""

from __future__ import annotations

import pytest
import torch

import onepass.attention.backends as backends
from onepass.attention import BackendError, layer_windows, supported_backend
from onepass.attention.cpu_tiles import CpuAttentionError
from onepass.attention.cpu import register as register_onepass_cpu
from onepass.conversation.parse import Conversation, Message
from onepass.data.mathchat import load_sample
from onepass.loss import layout_loss, view_loss_reference
from onepass.model.precision import float64_norms
from onepass.render import render_views
from onepass.layout.schedule import parse_schedule, schedule_views
from onepass.model.tiny import EXACT_ARCHS, HYBRID_ARCHS, WINDOWED_ARCHS, tiny_config, tiny_model
from onepass.verify.check import compact_vocab, run_verify

from exactness import loss_and_grads, max_rel_diff, n_pass, tree_runs

TOL = 1e-9

# many short turns: a window of 8-16 positions ends inside earlier turns, not just inside this one
LONG_CHAT = Conversation(messages=tuple(
    m for i in range(6) for m in (
        Message(role="user", content=f"Step {i}: add {i + 3} to the total."),
        Message(role="assistant", content=f"Total is now {sum(range(3, i + 4))}.",
                reasoning=f"Previous total plus {i + 3}." if i % 3 else ""),
    )))


@pytest.fixture(scope="module")
def conversations(qwen3_tokenizer):
    views, vocab = compact_vocab([render_views(c, qwen3_tokenizer) for c in load_sample(limit=2) + [LONG_CHAT]])
    assert len(views[-1]) == 6
    return views, vocab


def reference_backend(arch):
    return "eager" if arch == "gpt-oss" else "sdpa"


def cpu_backends(arch):
    """The backends a user gets on CPU: ours (chosen automatically) and the reference's dense one."""
    return [supported_backend(tiny_config(arch, 16), "cpu"), reference_backend(arch)]


def exact_model(arch, vocab, backend):
    model = tiny_model(arch, vocab, dtype=torch.float64, attn_implementation=backend)
    patched, left = float64_norms(model)
    assert patched > 0 and not left
    return model


@pytest.mark.parametrize("arch", EXACT_ARCHS)
def test_loss_and_every_gradient_equal_n_pass(conversations, one_thread, arch):
    views, vocab = conversations
    register_onepass_cpu()
    reference = exact_model(arch, vocab, reference_backend(arch))
    want = loss_and_grads(reference, n_pass(reference, views))
    for backend in cpu_backends(arch):
        model = reference if backend == reference_backend(arch) else exact_model(arch, vocab, backend)
        for name, run in tree_runs(model, views).items():
            diff = max_rel_diff(loss_and_grads(model, run), want)
            assert diff <= TOL, f"{arch} {backend} {name}: {diff:.2e}"


def test_one_pass_through_verify_on_a_windowed_model(conversations, one_thread):
    views, vocab = conversations
    report = run_verify(views, exact_model("olmo3", vocab, supported_backend(tiny_config("olmo3", 16), "cpu")))
    assert report.one_pass_tokens < report.n_pass_tokens
    assert report.rel_loss_diff <= TOL and report.max_rel_grad_diff <= TOL


# --------------------------------------------------------------------------------------------
# the tests can fail: a mask without the window differs, and onepass_cpu refuses it outright


@pytest.mark.parametrize("arch", ["mistral-window", "qwen3-window", "gpt-oss"])
def test_dropping_the_window_from_the_mask_differs(conversations, one_thread, monkeypatch, arch):
    views, vocab = conversations
    model = exact_model(arch, vocab, reference_backend(arch))
    layouts = [x for vs in views for x in schedule_views(vs, parse_schedule("one-pass")).layouts]
    with torch.no_grad():
        want = sum(view_loss_reference(model, v).item() for vs in views for v in vs)
        exact = sum(layout_loss(model, x).item() for x in layouts)
        monkeypatch.setattr(backends, "layer_windows",
                            lambda config: {k: None for k in layer_windows(config)})
        windowless = sum(layout_loss(model, x).item() for x in layouts)
    assert abs(exact - want) <= TOL * want
    assert abs(windowless - want) > 1e-6 * want


def test_onepass_cpu_refuses_a_mask_cut_for_another_window(conversations, monkeypatch):
    views, vocab = conversations
    model = exact_model("qwen3-window", vocab, register_onepass_cpu())
    layout = schedule_views(views[0], parse_schedule("one-pass")).layouts[0]
    monkeypatch.setattr(backends, "layer_windows", lambda config: {k: None for k in layer_windows(config)})
    with pytest.raises(CpuAttentionError, match="layer 1 has sliding_window=12 .* window=None"):
        layout_loss(model, layout)


def test_tiny_windows_cut_the_conversations(conversations):
    """Windows are short enough to cut every conversation, and they reach across branch points: some
    query sees a key q - k >= W rows back (a window on row indices would hide it)."""
    from onepass.attention.mask import dense_mask

    views, _ = conversations
    for arch in WINDOWED_ARCHS:
        windows = [w for w in layer_windows(tiny_config(arch, 16)).values() if w is not None]
        assert windows and all(max(windows) * 4 < max(map(len, vs)) for vs in views), arch
        for vs in views:
            layout = schedule_views(vs, parse_schedule("one-pass")).layouts[0]
            mask_QK = dense_mask(layout.kv_end, position_ids=layout.position_ids, window=max(windows))
            q_Q1, k_1K = torch.arange(len(layout))[:, None], torch.arange(len(layout))[None, :]
            assert (mask_QK & (q_Q1 - k_1K >= max(windows))).any(), arch


# --------------------------------------------------------------------------------------------
# which mask each layer type gets, and which backend each model gets


def test_layer_windows_follow_each_config():
    one, full, window = backends.ONE_MASK, backends.FULL, backends.WINDOW
    assert layer_windows(tiny_config("llama", 16)) == {one: None}
    assert layer_windows(tiny_config("mistral", 16)) == {one: None}  # window off
    assert layer_windows(tiny_config("mistral-window", 16)) == {one: 16}  # every layer
    assert layer_windows(tiny_config("qwen3-window", 16)) == {full: None, window: 12}  # from max_window_layers
    assert layer_windows(tiny_config("qwen3-window", 16, max_window_layers=2)) == {one: None}  # none windowed
    assert layer_windows(tiny_config("gpt-oss", 16)) == {window: 8, full: None}
    assert layer_windows(tiny_config("gemma3", 16)) == {window: 8, full: None}
    assert layer_windows(tiny_config("olmo3", 16, layer_types=[window, window])) == {window: 16}
    import transformers as tf

    multimodal = tf.Gemma3Config(text_config=tiny_config("gemma3", 16).to_dict())
    assert layer_windows(multimodal) == {window: 8, full: None}  # the language model's layers
    with pytest.raises(BackendError, match="bidirectional"):
        layer_windows(tiny_config("gemma3", 16, use_bidirectional_attention=True))


def test_supported_backend_picks_one_the_model_can_run():
    register_onepass_cpu()
    for arch in EXACT_ARCHS:
        assert supported_backend(tiny_config(arch, 16), "cpu") == "onepass_cpu", arch
        assert supported_backend(tiny_config(arch, 16), "cuda") == "flex_attention", arch
    capped = tiny_config("gemma3", 16, attn_logit_softcapping=30.0)
    assert supported_backend(capped, "cpu") == "eager"  # neither onepass_cpu nor sdpa soft-caps
    model = tiny_model("gpt-oss", 16, attn_implementation="eager")
    assert supported_backend(model, "cpu") == "onepass_cpu"
    assert supported_backend(model, "mps") == "eager"  # gpt-oss refuses sdpa


@pytest.mark.parametrize("backend", ["sdpa", "eager", "flex_attention", "onepass_cpu"])
def test_attention_mask_for_builds_one_mask_per_layer_type(backend):
    from torch.nn.attention.flex_attention import BlockMask

    from onepass.attention.mask import dense_mask
    from onepass.layout.tree import build_layout

    from strategies import V

    register_onepass_cpu()
    layout = build_layout([V(list(range(20)), 5), V(list(range(12)) + [30] * 9, 14)])
    kv_end_BL, pos_BL = torch.as_tensor(layout.kv_end)[None], torch.as_tensor(layout.position_ids)[None]
    model = tiny_model("gpt-oss", 40, attn_implementation="eager")
    model.config._attn_implementation = backend
    masks = backends.attention_mask_for(model, kv_end_BL, position_ids_BL=pos_BL, block_size=4)
    assert set(masks) == {"full_attention", "sliding_attention"}
    for layer_type, window in (("full_attention", None), ("sliding_attention", 8)):
        want = dense_mask(kv_end_BL, position_ids=pos_BL, window=window)[:, None]
        got = masks[layer_type]
        if backend == "sdpa":
            assert torch.equal(got, want)
        elif backend == "eager":
            assert torch.equal(got == 0, want)
        elif backend == "flex_attention":
            assert isinstance(got, BlockMask)
            from torch.nn.attention.flex_attention import create_mask
            assert torch.equal(create_mask(got.mask_mod, 1, None, len(layout), len(layout), device="cpu"), want)
        else:
            assert got.onepass_segment_plan.window == window
    assert not torch.equal(dense_mask(kv_end_BL, position_ids=pos_BL, window=8), dense_mask(kv_end_BL))


# --------------------------------------------------------------------------------------------
# hybrids: exact since onepass.mixers (tests/mixers/test_hybrids.py); here they run on every schedule


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_hybrids_are_exact_on_one_pass(conversations, one_thread, arch):
    views, vocab = conversations
    model = tiny_model(arch, vocab, dtype=torch.float64)
    float64_norms(model)
    layouts = [x for vs in views[:1] for x in schedule_views(vs, parse_schedule("one-pass")).layouts]
    with torch.no_grad():
        want = sum(view_loss_reference(model, v).item() for v in views[0])
        got = sum(layout_loss(model, x).item() for x in layouts)
    assert abs(got - want) <= TOL * want
