"""Views with real reasoning-model chat templates (tests/fixtures/chat_templates, sources in SOURCES.md).

For every template and every tool-chain conversation of ``onepass.template_report.TOOL_CHAIN_RECORDS``: nothing crashes (a turn the template
cannot split, or raises for, is a counted skip with its reason), and every kept view is exactly the
template's own rendering: prompt = template(messages[:k], add_generation_prompt=True), completion =
what the template renders for turn k, each tokenised on its own. The Qwen3 vocabulary stands in for
every model's (the issue's experiment did the same): the check is about text, not ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from onepass.conversation import parse_record
from onepass.prepare import PrepareConfig, prepare
from onepass.render import render_conversation
from onepass.template_probe import template_fields
from onepass.template_report import (
    TOOL_CHAIN_RECORDS,
    template_report,
    tool_chain_conversations,
)

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
RECORDS = TOOL_CHAIN_RECORDS
TEMPLATES = sorted(p.stem for p in FIXTURES.glob("*.jinja"))
# What each template is probed to expect: (tool-call arguments, reasoning key). transformers hands
# ``reasoning_content`` to templates that read ``thinking`` (gpt-oss, LFM2.5), so that key works there too.
FIELDS = {"deepseekv3": ("json", "reasoning_content")}
# (conversations with a kept view, kept views) of the 6 conversations / 12 assistant turns above.
# Every other turn is a counted skip, never a crash. Why each is skipped:
#   cohere2: raises "roles must alternate" on tool messages; does not render reasoning.
#   deepseekv3: R1-style generation prompt (opens <think>, reasoning never rendered; after a tool
#     output there is no generation prompt at all): needs a derived generation format (issue 16, item 2).
#   gptoss: raises "Cannot pass both content and thinking" for a tool-call turn with both (and every
#     later prompt holds that turn); drops a tool call's analysis once a final answer follows.
#   nemotron_3_*: a turn with empty reasoning renders differently from the <think> generation prompt.
#   qwen3_instruct_2507: a non-thinking template never renders reasoning (only reasoning-free turns kept).
KEPT = {"cohere2": (1, 1), "deepseekv3": (0, 0), "gptoss": (5, 7), "nemotron_3_nano": (6, 10),
        "nemotron_3_super": (6, 10), "nemotron_3_ultra": (6, 10), "qwen3_instruct_2507": (2, 2)}


@pytest.fixture
def template_tokenizer(qwen3_tokenizer, request):
    """The Qwen3 tokenizer with a vendored template for the duration of one test."""
    before = qwen3_tokenizer.chat_template
    qwen3_tokenizer.chat_template = (FIXTURES / f"{request.param}.jinja").read_text(encoding="utf-8")
    yield qwen3_tokenizer
    qwen3_tokenizer.chat_template = before


def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("template_tokenizer", TEMPLATES, indirect=True)
def test_every_kept_view_is_the_templates_own_rendering(template_tokenizer, request):
    tok = template_tokenizer
    name = request.node.callspec.params["template_tokenizer"]
    kept_conversations = kept_views = 0
    fields = template_fields(tok, {})
    convs = [parse_record(r, source="chains.jsonl", index=i) for i, r in enumerate(RECORDS)]
    for conv in convs:
        rendered = render_conversation(conv, tok)
        kept_conversations += bool(rendered.views)
        kept_views += len(rendered.views)
        turns = [k for k, m in enumerate(conv.messages) if m.role == "assistant"]
        assert len(rendered.views) + len(rendered.skipped) == len(turns)
        for error in rendered.skipped:
            assert str(error).startswith(f"{conv.source}, message ") and error.reason.startswith("template")
        for view in rendered.views:
            def text(upto, gen, conv=conv):
                return tok.apply_chat_template(
                    conv.template_messages(upto, arguments_json=fields.arguments_json,
                                           reasoning_key=fields.reasoning_key),
                    tools=conv.template_tools(), tokenize=False, add_generation_prompt=gen)
            prompt, full = text(view.turn, True), text(view.turn + 1, False)
            assert full.startswith(prompt)
            completion = full[len(prompt):]
            assert view.tokens.tolist() == encode(tok, prompt) + encode(tok, completion)
            assert view.num_prompt == len(encode(tok, prompt))
            message = conv.messages[view.turn]
            assert all(c.name in completion for c in message.tool_calls)  # tool calls are trained
            if (message.reasoning or "").strip():
                assert message.reasoning.strip() in completion  # so is reasoning
    assert (kept_conversations, kept_views) == KEPT.get(name, (len(RECORDS), 12))


@pytest.mark.parametrize("template_tokenizer", TEMPLATES, indirect=True)
def test_the_probe_hands_fields_over_as_the_template_reads_them(template_tokenizer, request):
    name = request.node.callspec.params["template_tokenizer"]
    fields = template_fields(template_tokenizer, {})
    assert (fields.arguments, fields.reasoning_key) == FIELDS.get(name, ("dict", "reasoning_content"))


@pytest.mark.parametrize("template_tokenizer", ["gptoss"], indirect=True)
def test_parallel_prepare_counts_every_kind_of_skip_as_serial_does(template_tokenizer, tmp_path):
    from onepass.data.parallel import prepare_parallel

    data = tmp_path / "chains.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS), encoding="utf-8")
    config = PrepareConfig(max_tokens=200)
    convs = [parse_record(r, source=str(data), index=i + 1, unit="line") for i, r in enumerate(RECORDS)]
    rows, stats = prepare(convs, template_tokenizer, config)
    # record 1 has two kinds: a turn that cannot be split and a view over the budget
    assert set(stats.skipped_by_reason) == {"template", "template error", "over max_tokens"}
    got_rows, got = prepare_parallel(data, template_tokenizer, config, num_proc=1)
    assert got.to_dict() == stats.to_dict()
    assert [r.input_ids.tolist() for r in got_rows] == [r.input_ids.tolist() for r in rows]


@pytest.mark.parametrize("template_tokenizer", ["gptoss"], indirect=True)
def test_templates_check_reports_what_prepare_keeps(template_tokenizer):
    report = template_report(tool_chain_conversations(), template_tokenizer, name="gptoss.jinja")
    assert (report.conversations, report.conversations_kept) == (6, KEPT["gptoss"][0])
    assert (report.views, report.views_split, report.views_skipped) == (12, KEPT["gptoss"][1], 5)
    assert report.skipped_by_reason == {"template": 1, "template error": 4}
    assert report.first_skip["template error"].startswith("tool-chain sample record 2, message 1: the chat "
                                                          "template raised at line 290")
    # turns with reasoning, kept: tool calls (record 1 turn 1 kept; record 2 turns 1, 3 raise),
    # answers after a tool result (record 5 kept; record 1 drops the call's analysis, record 2 raises),
    # answers after a user message (records 0, 3, 4 kept; record 2 turn 7 raises)
    assert report.reasoning == {"tool-call turn": [1, 3], "answer after a tool result": [1, 3],
                                "answer after a user message": [3, 4]}
    _, stats = prepare(tool_chain_conversations(), template_tokenizer)
    assert stats.views_trained == report.views_split
    assert f"template: {report.views_split} of {report.views} views split cleanly" in stats.summary()


def test_templates_check_command(capsys):
    from onepass.cli import main

    assert main(["templates", "check", "--tokenizer", "builtin:qwen3",
                 "--chat-template", str(FIXTURES / "deepseekv3.jinja")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"template {FIXTURES / 'deepseekv3.jinja'} (tool-call arguments: json, reasoning field: reasoning_content)"
    assert out[1] == ("conversations 6 (0 with a kept view); views 12: 0 split cleanly, 0 use a derived format, "
                      "12 skipped")
    assert out[-1].startswith("reasoning trained on: tool-call turn 0/3, ")


@pytest.mark.parametrize("template_tokenizer", ["deepseekv3"], indirect=True)
def test_eval_prompts_use_the_fields_the_template_expects(template_tokenizer):
    """`onepass eval` renders its prompts through render.render_prompt, with the probed fields: a
    template that concatenates tool-call arguments as a JSON string gets one (a dict crashed it)."""
    from onepass.evaluate.run import template_prompt

    prompt = template_prompt(template_tokenizer)
    for record in RECORDS:
        conv = parse_record(record)
        calls = [m for m in conv.messages if m.tool_calls]
        for k, message in enumerate(conv.messages):
            if message.role == "assistant":
                assert isinstance(prompt(conv, k), str)  # renders (the dict form raised TypeError)
        if calls:
            last = len(conv.messages)
            assert json.dumps(calls[0].tool_calls[0].arguments, ensure_ascii=False) in prompt(conv, last)
