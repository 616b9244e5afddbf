"""The derived generation format (onepass.render.derived): a turn the template cannot split is
still trained, with exactly what the model sees at inference (the template's own prompt) followed by
what it generates (the template's own rendering of that turn as the last message)."""

from __future__ import annotations

from pathlib import Path

import pytest

from onepass.conversation.parse import parse_record
from onepass.render.derived import read_completion
from onepass.prepare.pipeline import prepare
from onepass.render import (
    RenderConfig,
    RenderError,
    merges_across,
    render_conversation,
    render_texts,
)
from onepass.render.fields import template_fields
from onepass.render.messages import template_messages, template_tools
from onepass.prepare.template_report import tool_chain_conversations

FIXTURES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
TEMPLATES = sorted(p.stem for p in FIXTURES.glob("*.jinja"))

# Nemotron 3 in four lines: the generation prompt opens <think>, an empty reasoning renders <think></think>.
EMPTY_THINK = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n{% else %}<think></think>"
    "{% endif %}{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
# gpt-oss in five lines: an assistant turn's reasoning is dropped from the history once an assistant
# answer follows, so the history differs from the one in the prompt.
DROPS_HISTORY = (
    "{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' and m.reasoning_content and "
    "(loop.last or messages[-1].role != 'assistant') %}<|analysis|>{{ m.reasoning_content }}<|end|>{% endif %}"
    "<|message|>{{ m.content }}{% for c in m.tool_calls or [] %}<|call|>{{ c.function.name }}{% endfor %}"
    "<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
# Kimi-K2-Thinking in four lines: a final answer (and every turn before it) is rendered <think></think>,
# even as the last turn; a tool-call turn after it keeps <think>R</think>; a call is rendered by its id.
KIMI = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'assistant' and not m.tool_calls %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}<{{ m.role }}>"
    "{% if m.role == 'assistant' %}<think>{% if loop.index0 > ns.last %}{{ m.reasoning_content }}{% endif %}"
    "</think>{% endif %}{{ m.content }}{% for c in m.tool_calls or [] %}<call>{{ c.id }}{% endfor %}<end>"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
R1 = ("{% for m in messages %}{% if m.role == 'user' %}<U>{{ m.content }}{% else %}<A>{{ m.content }}<E>{% endif %}"
      "{% endfor %}{% if add_generation_prompt %}<A><think>\n{% endif %}")


def conv(*turns):
    messages = []
    for i, t in enumerate(turns):
        messages.append({"role": "user", "content": f"q{i}"})
        messages.append({"role": "assistant", "content": t[1], "reasoning_content": t[0]})
    return parse_record({"messages": messages}, source="x.jsonl", index=0)


def test_read_completion_finds_the_turn_after_its_generation_prompt():
    assert read_completion("<u>q<a>", "<u>q", "<u>q<a>R<e>", anchors=["R"]) == "R<e>"
    # history rendered differently once the turn follows: the generation prompt is found before the turn
    assert read_completion("<u>q<a>x<e><a>", "<u>q<a>x<e>", "<u>q<a><e><a>R<e>", anchors=["R"]) == "R<e>"
    # no anchor rendered, or a generation prompt only in the history: not derived, and says why
    assert read_completion("<u>q<a>", "<u>q", "<u>Q<e>", anchors=["R"]).problem
    missing = read_completion("<U>q<A><think>\n", "<U>q", "<U>q<A>C<E>", anchors=["C"])
    assert "opens '<think>\\n'" in missing.hint and "--completion-format deepseek-r1" in missing.hint
    earlier = read_completion("<x>long question<e><a>", "<x>long question<e>", "<a>long question<e>R<f>",
                              anchors=["R"], history_texts=["long question"])
    assert earlier.problem.startswith("the generation prompt found before the probe turn belongs")


def test_an_empty_reasoning_the_template_renders_apart_is_trained_as_generated(with_template):
    tok = with_template(EMPTY_THINK)
    rendered = render_conversation(conv(("", "hi"), ("why", "ok")), tok)
    assert [(v.turn, v.provenance.derived) for v in rendered.views] == [(1, True), (3, False)]
    (_, prompt, completion), _ = render_texts(conv(("", "hi"), ("why", "ok")), tok)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    assert completion == "\n</think>\nhi<|im_end|>\n"  # the format of a turn with reasoning, reasoning empty
    _, stats = prepare([conv(("", "hi"), ("why", "ok"))], tok)
    assert (stats.views_trained, stats.provenance["derived"], stats.views_skipped) == (2, 1, 0)
    assert "template: 1 of 2 views split cleanly, 1 use the generation format derived" in stats.summary()


def test_a_history_rendered_differently_keeps_the_turn_as_the_template_renders_it(with_template):
    tok = with_template(DROPS_HISTORY)
    record = {"messages": [{"role": "user", "content": "q"},
                           {"role": "assistant", "content": "", "reasoning_content": "call",
                            "tool_calls": [{"function": {"name": "calc", "arguments": {}}}]},
                           {"role": "tool", "content": "3"},
                           {"role": "assistant", "content": "three", "reasoning_content": "done"}]}
    texts = render_texts(parse_record(record), tok)
    (_, prompt, completion) = texts[1]
    assert "<|analysis|>call" in prompt  # at inference the model sees the tool call's reasoning ...
    assert completion == "<|analysis|>done<|end|><|message|>three<|end|>"  # ... and generates this turn


def test_no_format_is_derived_where_the_template_never_shows_how_the_turn_is_closed(with_template):
    tok = with_template(R1)
    with pytest.raises(RenderError, match=r"opens '<think>\\n'.*pass --completion-format deepseek-r1"):
        render_texts(conv(("r", "a")), tok)
    (view,) = render_conversation(conv(("r", "a")), tok, RenderConfig(completion_format="deepseek-r1")).views
    assert tok.decode(view.tokens[view.num_prompt:]) == "r\n</think>\n\na<E>"  # the template's end of turn


def test_an_answer_whose_reasoning_the_template_drops_gets_the_block_of_a_tool_call_turn(with_template):
    tok = with_template(KIMI)
    assert template_fields(tok, {}).tool_ids == "functions"  # a call's name is only in its id
    record = {"messages": [{"role": "user", "content": "q"},
                           {"role": "assistant", "content": "", "reasoning_content": "call",
                            "tool_calls": [{"id": "call_0", "function": {"name": "calc", "arguments": {}}}]},
                           {"role": "tool", "content": "3", "tool_call_id": "call_0"},
                           {"role": "assistant", "content": "three", "reasoning_content": "done"}]}
    (_, _, call), (_, prompt, answer) = render_texts(parse_record(record), tok)
    assert call == "<think>call</think><call>functions.calc:0<end>"  # split by the template
    assert prompt.endswith("<think>call</think><call>functions.calc:0<end><tool>3<end><assistant>")
    assert answer == "<think>done</think>three<end>"  # the template renders <think></think>three<end>
    assert [v.provenance.derived for v in render_conversation(parse_record(record), tok).views] == [False, True]


def test_a_template_that_never_renders_reasoning_still_skips_the_turn(with_template):
    tok = with_template(KIMI.replace("{{ m.reasoning_content }}", ""))  # not even on a tool-call turn
    rendered = render_conversation(conv(("r", "a"), ("", "b")), tok)
    assert [v.turn for v in rendered.views] == [3]
    assert "does not render this turn's reasoning" in str(rendered.skipped[0])


def test_the_summary_says_views_come_from_the_completion_format(with_template):
    from onepass.prepare.pipeline import PrepareConfig

    record = {"messages": [{"role": "user", "content": "q"},
                           {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "calc"}}]},
                           {"role": "tool", "content": "3"}, {"role": "assistant", "content": "a"}]}
    config = PrepareConfig(completion_format="deepseek-r1")
    _, stats = prepare([parse_record(record)], with_template(R1), config)
    assert "template: 1 of 2 views from the completion format, 0 use the generation format derived from the " \
           "template, 1 skipped" in stats.summary()


@pytest.fixture
def vendored(with_template):
    """The Qwen3 vocabulary with a vendored template (by file name) for one test."""
    return lambda name: with_template((FIXTURES / f"{name}.jinja").read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", TEMPLATES)
def test_every_derived_view_is_the_templates_prompt_and_its_own_rendering_of_the_turn(vendored, name):
    """Reference, from the template alone: the prompt is its rendering of messages[:k] with the
    generation prompt; the completion is (a) what it renders for the turn after that generation prompt
    when the turn comes last (only the history differs: gpt-oss), or (b) for a turn with empty
    reasoning, what it renders for the same turn with a reasoning, that reasoning taken out (Nemotron),
    or (c) for an answer whose reasoning it drops even as the last turn, its own rendering of the turn
    with the reasoning block it renders when the same turn makes a tool call (Kimi-K2)."""
    tok = vendored(name)
    fields = template_fields(tok, {})
    derived = 0
    for c in tool_chain_conversations():
        for view in render_conversation(c, tok).views:
            if not view.provenance.derived:
                continue
            derived += 1

            def text(messages, gen, c=c):
                return tok.apply_chat_template(messages, tools=template_tools(c), tokenize=False,
                                               add_generation_prompt=gen)
            history = template_messages(c, view.turn, **fields.message_options)
            prompt = text(history, True)
            completion = tok.decode(view.tokens[view.num_prompt:])
            assert view.tokens[:view.num_prompt].tolist() == tok(prompt, add_special_tokens=False)["input_ids"]
            turn = template_messages(c, view.turn + 1, **fields.message_options)[-1]
            generation = prompt[len(text(history, False)):]
            own = text(history + [turn], False)
            if own.endswith(generation + completion):  # (a)
                continue
            reasoning = (c.messages[view.turn].reasoning or "").strip()
            if reasoning:  # (c) the answer's reasoning dropped even as the last turn (Kimi-K2)
                own_turn = own[own.rfind(generation) + len(generation):]
                assert completion.replace(reasoning, "", 1) == own_turn  # the same turn, its empty block filled
                call = {"type": "function", "id": "functions.f:0", "function": {"name": "f", "arguments": {}}}
                with_call = text(history + [{**turn, "tool_calls": [call]}], False)
                assert completion[:completion.index(c.messages[view.turn].content)] in with_call
                continue
            marked = text(history + [{**turn, fields.reasoning_key: "MARK"}], False)
            assert marked.startswith(prompt) and marked[len(prompt):].replace("MARK", "") == completion
    expected = {"gptoss": 1, "kimi_k2_thinking": 7, "minimax_m2": 2, "nemotron_3_nano": 2, "nemotron_3_super": 2, "nemotron_3_ultra": 2}
    assert derived == expected.get(name, 0)


@pytest.mark.parametrize("name", TEMPLATES)
def test_boundary_merges_on_a_window_equal_the_whole_text_reference(vendored, name):
    tok = vendored(name)
    pairs = [(p, c) for conv_ in tool_chain_conversations()
             for _, t in _texts(conv_, tok) for p, c in [(t.prompt, t.completion)]]
    whole = [tok(p + c, add_special_tokens=False)["input_ids"]
             != tok(p, add_special_tokens=False)["input_ids"] + tok(c, add_special_tokens=False)["input_ids"]
             for p, c in pairs]
    assert merges_across(tok, pairs) == whole


def _texts(c, tok):
    from onepass.render.views import _iter_texts

    return [t for t in _iter_texts(c, tok, RenderConfig()) if not isinstance(t[1], RenderError)]


def test_a_developer_prompt_goes_over_as_developer_where_the_template_renders_it(vendored):
    record = {"messages": [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "hello"}]}
    c = parse_record(record)
    assert (c.system, c.system_role) == ("Be terse.", "developer")
    gptoss = vendored("gptoss")
    assert template_fields(gptoss, {}).developer
    ((_, prompt, _),) = render_texts(c, gptoss)
    assert "<|start|>developer<|message|># Instructions\n\nBe terse." in prompt
    qwen = vendored("qwen3")
    assert not template_fields(qwen, {}).developer  # Qwen3 would drop a developer message: it goes as system
    ((_, prompt, _),) = render_texts(c, qwen)
    assert prompt.startswith("<|im_start|>system\nBe terse.<|im_end|>")
