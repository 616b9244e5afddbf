"""Loss and gradient equivalence with plain per-view HF forward passes (float64).

The reference (:func:`onepass.loss.view_loss_reference`) is what a user runs
without onepass: each view alone, no position ids, no mask, full logits, the
usual shift. Everything onepass does (rendering aside) is on the other side.
"""

from __future__ import annotations

import pytest
import torch

from onepass.conversation.parse import Conversation, Message, ToolCall
from onepass.data.mathchat import load_sample
from onepass.loss import batch_loss, layout_loss, layouts_to_batch, view_loss_reference
from onepass.layout.pack import pack_layouts
from onepass.model.precision import float64_norms
from onepass.render import render_views
from onepass.layout.schedule import schedule_views
from onepass.model.tiny import DENSE_ARCHS, tiny_model
from onepass.verify.check import compact_vocab, run_verify

TOL = 1e-9

TOOL_CHAIN = Conversation(
    system="You are a careful calculator.",
    tools=({"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}},),
    messages=(
        Message(role="user", content="What is 17 * 23? ünïcödé ✓"),
        Message(role="assistant", content="", reasoning="Use the tool.",
                tool_calls=(ToolCall(name="calc", arguments={"expr": "17*23"}),)),
        Message(role="tool", content="391"),
        Message(role="assistant", content="17 * 23 = 391.", reasoning="The tool said 391."),
        Message(role="user", content="And plus 9?"),
        Message(role="assistant", content="400.", reasoning=""),  # empty reasoning: still trained
        Message(role="user", content="Thanks"),
        Message(role="assistant", content="You're welcome.", reasoning="Be polite."),
    ),
)


@pytest.fixture(scope="module")
def conversations(qwen3_tokenizer):
    convs = load_sample(limit=2) + [TOOL_CHAIN]
    views, vocab = compact_vocab([render_views(c, qwen3_tokenizer) for c in convs])
    return views, vocab


def exact_model(arch, vocab, **kw):
    model = tiny_model(arch, vocab, dtype=torch.float64, **kw)
    patched, left = float64_norms(model)
    assert patched > 0 and not left
    return model


@pytest.mark.parametrize("arch", DENSE_ARCHS)  # the other architectures: test_architectures.py
def test_one_pass_loss_and_gradients_equal_n_pass(conversations, arch):
    views, vocab = conversations
    report = run_verify(views, exact_model(arch, vocab), schedule="one-pass")
    assert report.num_views == sum(len(v) for v in views)
    assert report.one_pass_tokens < report.n_pass_tokens
    assert report.rel_loss_diff <= TOL
    assert report.max_rel_grad_diff <= TOL


@pytest.mark.parametrize("schedule", ["n-pass", "k-pass:2", "k-pass:3"])
def test_every_schedule_equals_n_pass(conversations, schedule):
    views, vocab = conversations
    report = run_verify(views, exact_model("qwen3", vocab), schedule=schedule)
    assert report.rel_loss_diff <= TOL and report.max_rel_grad_diff <= TOL


def test_budget_schedule_splits_and_equals_n_pass(conversations):
    views, vocab = conversations
    budget = max(len(v) for vs in views for v in vs) + 10
    report = run_verify(views, exact_model("llama", vocab), schedule="budget", max_tokens=budget)
    assert report.num_trees > len(views)  # at least one conversation was split
    assert report.rel_loss_diff <= TOL and report.max_rel_grad_diff <= TOL


def _loss_and_grads(model, fn):
    model.zero_grad(set_to_none=True)
    loss = fn()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def _assert_same(a, b):
    (la, ga), (lb, gb) = a, b
    assert abs(la - lb) <= TOL * abs(la)
    for x, y in zip(ga, gb):
        assert (x - y).norm() <= TOL * max(x.norm(), 1e-300)


def test_turn_weighting_equals_mean_per_view(conversations):
    views, vocab = conversations
    model = exact_model("qwen3", vocab)

    def n_pass():  # each view's tokens averaged, then summed over views
        return sum(view_loss_reference(model, v) / v.num_completion for vs in views for v in vs)

    def one_pass():
        return sum(layout_loss(model, x) for vs in views
                   for x in schedule_views(vs, _one(), weighting="turn").layouts)

    _assert_same(_loss_and_grads(model, n_pass), _loss_and_grads(model, one_pass))


def test_conversation_weighting_equals_mean_per_conversation(conversations):
    views, vocab = conversations
    model = exact_model("mistral", vocab)

    def n_pass():
        return sum(sum(view_loss_reference(model, v) for v in vs) / sum(v.num_completion for v in vs)
                   for vs in views)

    def one_pass():
        return sum(layout_loss(model, x) for vs in views
                   for x in schedule_views(vs, _one(), weighting="conversation").layouts)

    _assert_same(_loss_and_grads(model, n_pass), _loss_and_grads(model, one_pass))


def test_packed_batch_with_padding_equals_n_pass(conversations):
    views, vocab = conversations
    model = exact_model("qwen2", vocab)
    layouts = [x for vs in views for x in schedule_views(vs, _one()).layouts]
    rows = pack_layouts(layouts, max(len(x) for x in layouts) + 50)
    assert len(rows) >= 2  # a real batch, rows of different lengths -> padding

    def n_pass():
        return sum(view_loss_reference(model, v) for vs in views for v in vs)

    def packed():
        return batch_loss(model, layouts_to_batch(rows))

    _assert_same(_loss_and_grads(model, n_pass), _loss_and_grads(model, packed))


def test_eager_backend_matches_to_float32_softmax_precision(conversations):
    # transformers' eager attention takes the softmax in float32 even for float64 models
    views, vocab = conversations
    report = run_verify(views, exact_model("llama", vocab, attn_implementation="eager"))
    assert report.rel_loss_diff <= 1e-6 and report.max_rel_grad_diff <= 1e-5


def test_float32_close(conversations):
    views, vocab = conversations
    report = run_verify(views, tiny_model("qwen3", vocab, dtype=torch.float32))
    assert report.rel_loss_diff <= 1e-5 and report.max_rel_grad_diff <= 1e-4


def test_without_explicit_mask_the_loss_differs(conversations):
    """The DESIGN pitfall: attention_mask=None lets the model guess; onepass always passes one."""
    views, vocab = conversations
    model = exact_model("qwen3", vocab)
    layout = schedule_views(views[0], _one()).layouts[0]
    batch = layouts_to_batch([layout])
    with torch.no_grad():
        good = batch_loss(model, batch).item()
        keep = (batch["targets"][0] != -100).nonzero().squeeze(1)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       logits_to_keep=keep).logits[0]
        guessed = torch.nn.functional.cross_entropy(logits, batch["targets"][0, keep], reduction="sum").item()
        reference = sum(view_loss_reference(model, v).item() for v in views[0])
    assert abs(good - reference) <= TOL * reference
    assert abs(guessed - reference) > 1e-6 * reference


def _one():
    from onepass.layout.schedule import parse_schedule

    return parse_schedule("one-pass")


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_onepass_cpu_backend_equals_n_pass(conversations, arch):
    """The default CPU backend (only visible pairs) through the normal mask path."""
    from onepass.attention.backends import default_backend

    views, vocab = conversations
    backend = default_backend("cpu")
    assert backend == "onepass_cpu"
    report = run_verify(views, exact_model(arch, vocab, attn_implementation=backend), schedule="one-pass")
    assert report.rel_loss_diff <= TOL and report.max_rel_grad_diff <= TOL
