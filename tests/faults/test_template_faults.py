"""Templates: the view is what the template renders for the record, and a skip says the right why (issue 37, round 3).

Before: SmolLM3's template renders an assistant ``content`` as it is (it reads no reasoning field), so its own
rendering of a record keeps ``<think>r</think>a`` in the history; onepass moved ``r`` into ``reasoning_content``,
which the template never reads, and dropped it: the turn was skipped ("reasoning not rendered") and every later
prompt showed ``a`` alone, a different view, not announced. For Apertus the skip blamed "the prompt, which holds
message 0" when the template raises for the record's ``tools`` list; for SmolLM3's tool-call turns (with a
completion format) it gave a DeepSeek-R1-Distill hint about ``content`` being None that does not apply.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from onepass.conversation.parse import parse_record
from onepass.prepare.pipeline import PrepareConfig, prepare
from onepass.render import RenderConfig, render_conversation

VENDORED = Path(__file__).parents[1] / "fixtures" / "chat_templates"
SHARED = Path(__file__).resolve().parents[2] / ".." / "shared" / "fixtures" / "chat_templates" / "reasoning"
INLINE = {"messages": [{"role": "user", "content": "2+2?"},
                       {"role": "assistant", "content": "<think>\nadd two and two\n</think>\n\nIt is 4."},
                       {"role": "user", "content": "And 3+3?"},
                       {"role": "assistant", "content": "<think>three and three</think>It is 6."}]}
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
CALL = {"tools": TOOLS, "messages": [
    {"role": "user", "content": "find x"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "lookup", "arguments": {"q": "x"}}}]},
    {"role": "tool", "content": "x=1"}, {"role": "assistant", "content": "x is 1"}]}


@pytest.fixture
def template(with_template):
    def use(path: Path):
        if not path.is_file():
            pytest.skip(f"{path} is not here (the shared fixtures beside the repository)")
        return with_template(path.read_text(encoding="utf-8"))
    return use


def _views_are_the_templates_rendering_of_the_record(tok, record):
    conv = parse_record(record, source="d.jsonl", index=1, unit="line")
    rendered = render_conversation(conv, tok)
    assert not rendered.skipped, [str(e) for e in rendered.skipped]
    raw = record["messages"]
    for view in rendered.views:
        prompt = tok.apply_chat_template(raw[:view.turn], tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(raw[:view.turn + 1], tokenize=False)
        assert tok.decode(view.tokens[:view.num_prompt]) == prompt
        assert tok.decode(view.tokens) == full[:len(tok.decode(view.tokens))] and full.startswith(prompt)
        assert conv.messages[view.turn].reasoning in tok.decode(view.tokens[view.num_prompt:])  # trained
    return conv, rendered


def test_an_inline_think_block_goes_over_as_given_where_the_template_reads_no_reasoning_field(template):
    # a vendored template that reads no reasoning field: Qwen3-Instruct-2507 renders a content as it is
    tok = template(VENDORED / "qwen3_instruct_2507.jinja")
    conv, rendered = _views_are_the_templates_rendering_of_the_record(tok, INLINE)
    assert [v.turn for v in rendered.views] == [1, 3] and rendered.inline_reasoning == 2
    _, stats = prepare([conv], tok, PrepareConfig())
    assert stats.conversions == {"leading <think> block kept in the content (the template reads no reasoning "
                                 "field)": 1}
    assert "read: 1 records leading <think> block kept in the content" in stats.summary()
    # a template that reads reasoning_content still gets it there (Qwen3: unchanged)
    tok = template(VENDORED / "qwen3.jinja")
    rendered = render_conversation(conv, tok)
    assert len(rendered.views) == 2 and rendered.inline_reasoning == 0


def test_smollm3_trains_the_think_block_it_renders_and_keeps_it_in_the_history(template):
    tok = template(SHARED / "smollm3.jinja")
    _, rendered = _views_are_the_templates_rendering_of_the_record(tok, INLINE)
    second = tok.decode(rendered.views[1].tokens[:rendered.views[1].num_prompt])
    assert "<think>\nadd two and two\n</think>\n\nIt is 4." in second  # the history as SmolLM3 renders it


def test_apertus_blames_the_tools_list_not_message_0(template):
    tok = template(SHARED / "apertus.jinja")
    rendered = render_conversation(parse_record(CALL, source="d.jsonl", index=1, unit="line"), tok)
    assert not rendered.views and len(rendered.skipped) == 2
    for error in rendered.skipped:
        assert "rendering the prompt with the record's tools list (1 tool), which the template raises for (the " \
               "messages render without it): UndefinedError: 'dict object' has no attribute 'description'" in str(error)
        assert "message 0" not in str(error)


def test_a_template_that_never_reads_tool_calls_gets_no_deepseek_hint(template):
    tok = template(SHARED / "smollm3.jinja")
    conv = parse_record(CALL, source="d.jsonl", index=1, unit="line")
    (error,) = render_conversation(conv, tok, RenderConfig(completion_format="think-tags")).skipped
    assert "DeepSeek-R1-Distill" not in str(error) and "only when the content is None" not in str(error)
    assert str(error).startswith("d.jsonl line 1, message 1: the chat template does not render this turn's tool call "
                                 "'lookup', so the completion format cannot fill {tool_calls}. This template never "
                                 "reads a message's tool_calls")
    # the template the hint is about still gets it
    tok = template(VENDORED / "deepseek_r1_distill.jinja")
    skipped = render_conversation(conv, tok, RenderConfig(completion_format="deepseek-r1")).skipped
    assert any("only when the content is None (DeepSeek-R1-Distill)" in str(e) for e in skipped)


def test_a_record_written_back_keeps_its_inline_block(tmp_path):
    from onepass.data.sources import to_record

    conv = parse_record(INLINE)
    back = to_record(conv)
    assert back["messages"][1]["content"] == INLINE["messages"][1]["content"]
    assert parse_record(json.loads(json.dumps(back))) == conv
