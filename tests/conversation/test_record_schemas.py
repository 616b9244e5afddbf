"""Records in the schemas public datasets use, read as the template would see them (issue 23).

Each test names the silent change it guards against; the views are checked against the real
template's own rendering of the record (tests/fixtures/chat_templates, the Qwen3 vocabulary).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from onepass.conversation.parse import Message, ToolCall, parse_record
from onepass.prepare.pipeline import PrepareConfig, prepare
from onepass.conversation.schemas import (
    CONTENT_NULL,
    CONTENT_PARTS,
    FIELD_AND_INLINE,
    HERMES_CALL,
    INPUT_OUTPUT,
    NOT_TRAINED,
    SHAREGPT_CALL,
)
from onepass.render import RenderConfig, render_conversation

FIXTURES = Path(__file__).parents[1] / "fixtures" / "chat_templates"


def U(content):
    return {"role": "user", "content": content}


def A(content, **kw):
    return {"role": "assistant", "content": content, **kw}


def one(record):
    return parse_record(record, source="d.jsonl", index=1, unit="line")


@pytest.fixture
def template(qwen3_tokenizer):
    """``template(name)``: the Qwen3 tokenizer with a vendored chat template, restored after the test."""
    before = qwen3_tokenizer.chat_template

    def use(name):
        qwen3_tokenizer.chat_template = (FIXTURES / f"{name}.jinja").read_text(encoding="utf-8")
        return qwen3_tokenizer

    yield use
    qwen3_tokenizer.chat_template = before


def texts(tok, conv, config=RenderConfig()):
    """(prompt, completion) text of each kept view."""
    rendered = render_conversation(conv, tok, config)
    return [(tok.decode(v.tokens[:v.num_prompt]), tok.decode(v.tokens[v.num_prompt:])) for v in rendered.views]


# ------------------------------------------------------------------ OpenAI fine-tuning "weight"


def test_an_assistant_message_with_weight_0_is_context_never_a_target(qwen3_tokenizer):
    record = {"messages": [U("q1"), A("skip me", weight=0), U("q2"), A("train me", weight=1)]}
    conv = one(record)
    assert [m.train for m in conv.messages] == [True, False, True, True]
    assert conv.conversions == (NOT_TRAINED,)
    (prompt, completion), = texts(qwen3_tokenizer, conv)
    assert "skip me" in prompt and "train me" in completion
    _, stats = prepare([conv], qwen3_tokenizer)
    assert (stats.views, stats.views_trained, stats.turns_not_trained) == (1, 1, 1)
    assert stats.conversions == {NOT_TRAINED: 1}
    assert "1 assistant turns not trained (weight 0)" in stats.summary()


# ------------------------------------------------------------------ an empty system message


@pytest.mark.parametrize("name", ["qwen3", "glm4moe", "kimi_k2_thinking"])
def test_an_empty_system_message_is_a_message_the_template_renders(template, name):
    tok = template(name)
    record = {"messages": [{"role": "system", "content": ""}, U("q"), A("a", reasoning_content="r")]}
    conv = one(record)
    assert conv.system == "" and conv.first_message == 1
    (prompt, _), = texts(tok, conv)
    assert prompt == tok.apply_chat_template(record["messages"][:2], tokenize=False, add_generation_prompt=True)
    # a blank top-level "system" field (a parquet column of a dataset without one) still means none
    assert one({"system": "", "messages": [U("q"), A("a")]}).system is None


# ------------------------------------------------------------------ inline <think> only where it leads


@pytest.mark.parametrize("content,reasoning,answer", [
    ("  \n<think>r</think>\n\na", "r", "a"),  # leading, after whitespace: reasoning
    ("Sure! Models such as R1 emit <think>...</think> and then answer.", None,
     "Sure! Models such as R1 emit <think>...</think> and then answer."),  # mid-answer: answer text
    ("Write <think> before you reason.", None, "Write <think> before you reason."),  # a mention, not cut off
    ("<think>r</think>a, then <think>x</think>", "r", "a, then <think>x</think>"),
])
def test_only_a_leading_think_block_is_reasoning(content, reasoning, answer):
    m = one({"messages": [U("q"), A(content)]}).messages[1]
    assert (m.reasoning, m.content) == (reasoning, answer)


def test_a_reasoning_field_wins_over_inline_tags_and_the_text_is_kept(template):
    content = "<think>quoted</think> is how R1 starts; the answer is 4."
    conv = one({"messages": [U("q"), A(content, reasoning_content="2+2=4")]})
    assert (conv.messages[1].reasoning, conv.messages[1].content) == ("2+2=4", content)
    assert conv.conversions == (FIELD_AND_INLINE,)
    # the same reasoning written twice (field and block) is one reasoning, as before
    twice = one({"messages": [U("q"), A("<think>r</think>a", reasoning_content="r")]}).messages[1]
    assert (twice.reasoning, twice.content) == ("r", "a")
    tok = template("qwen3")
    (prompt, completion), = texts(tok, conv)
    raw = [U("q"), A(content, reasoning_content="2+2=4")]
    assert prompt + completion == tok.apply_chat_template(raw, tokenize=False)


# ------------------------------------------------------------------ tool-call arguments as given

GIVEN = '{"city":"\\u5317\\u4eac","days":1e1}'


def tool_record(arguments=GIVEN):
    return {"messages": [U("weather?"), A("", tool_calls=[{"id": "c", "type": "function", "function": {
        "name": "forecast", "arguments": arguments}}]), {"role": "tool", "content": "sunny", "tool_call_id": "c"},
        A("Sunny.")]}


@pytest.mark.parametrize("name", ["qwen3", "deepseekv3", "kimi_k2_thinking"])
def test_a_json_string_argument_is_trained_byte_for_byte_where_the_template_renders_strings(template, name):
    tok = template(name)
    conv = one(tool_record())
    assert conv.messages[1].tool_calls[0] == ToolCall(name="forecast", arguments={"city": "北京", "days": 10.0},
                                                      id="c", text=GIVEN)
    config = RenderConfig(completion_format="deepseek-r1") if name == "deepseekv3" else RenderConfig()
    first = texts(tok, conv, config)[0][1]
    assert GIVEN in first and "北京" not in first
    _, stats = prepare([conv], tok, PrepareConfig(completion_format=config.completion_format))
    assert stats.tool_arguments_parsed == 0


@pytest.mark.parametrize("name", ["qwen3_5_think", "glm4moe"])
def test_a_json_string_argument_is_parsed_only_for_a_template_that_needs_a_dict_and_counted(template, name):
    tok = template(name)
    conv = one(tool_record())
    first = texts(tok, conv)[0][1]
    assert "北京" in first  # the template iterates the dict's items: it renders values, not the string
    _, stats = prepare([conv], tok)
    assert stats.tool_arguments_parsed == 1
    assert "1 JSON-string tool arguments parsed (the template needs a dict)" in stats.summary()


# ------------------------------------------------------------------ completion format vs generation prompt


def test_deepseek_v31_r1_format_after_a_tool_result_is_a_counted_skip_not_an_unopened_tag(template):
    tok = template("deepseekv3_1")
    record = tool_record('{"city": "Paris"}')
    record["messages"][1]["reasoning_content"] = "need the tool"
    record["messages"][3]["reasoning_content"] = "it said sunny"
    conv = one(record)
    config = RenderConfig(completion_format="deepseek-r1", template_kwargs={"thinking": True})
    rendered = render_conversation(conv, tok, config)
    for view in rendered.views:  # every kept target closes only a tag its prompt opened
        prompt = tok.decode(view.tokens[:view.num_prompt])
        completion = tok.decode(view.tokens[view.num_prompt:])
        assert "</think>" not in completion or prompt.rstrip().endswith("<think>")
    assert [v.turn for v in rendered.views] == [1]  # after the user message the prompt opens <think>
    (skip,) = rendered.skipped  # after the tool result it opens nothing
    assert skip.reason == "format not opened by the prompt"
    assert str(skip).startswith("d.jsonl line 1, message 3: the completion format closes </think> but this "
                                  "turn's generation prompt does not open <think>")
    _, stats = prepare([conv], tok, PrepareConfig(completion_format="deepseek-r1", template_kwargs={"thinking": True}))
    assert stats.skipped_by_reason == {"format not opened by the prompt": 1}


# ------------------------------------------------------------------ readers for common schemas

SHAREGPT_TOOLS = {  # LLaMA-Factory's sharegpt format with tools (glaive-function-calling style)
    "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
        {"from": "observation", "value": '{"temp": 18}'},
        {"from": "gpt", "value": "18 degrees."},
    ],
    "system": "You are helpful.",
    "tools": '[{"name": "get_weather", "description": "w", "parameters": {"type": "object", "properties": '
             '{"city": {"type": "string"}}}}]',
}
HERMES = {"messages": [  # Hermes function calling: calls inline in the assistant text
    U("Weather in Paris?"),
    A('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    {"role": "tool", "content": '{"temp": 18}'},
    A("18 degrees."),
]}
NEMOTRON = {"input": [U("2+2?")], "output": "<think>\n2+2=4\n</think>\n\n4", "system_prompt": "detailed thinking on",
            "reasoning": "on", "category": "math"}


def test_sharegpt_function_call_and_observation_speakers_are_a_tool_call_and_its_result():
    conv = one(SHAREGPT_TOOLS)
    assert conv.messages[1] == Message(role="assistant", content="", tool_calls=(
        ToolCall(name="get_weather", arguments={"city": "Paris"}),))
    assert conv.messages[2] == Message(role="tool", content='{"temp": 18}')
    assert conv.conversions == (SHAREGPT_CALL,) and conv.system == "You are helpful." and len(conv.tools) == 1


def test_hermes_inline_tool_calls_followed_by_a_tool_message_become_tool_calls():
    conv = one(HERMES)
    assert conv.messages[1] == Message(role="assistant", content="Let me check.", tool_calls=(
        ToolCall(name="get_weather", arguments={"city": "Paris"}),))
    assert conv.conversions == (HERMES_CALL,)
    # not followed by a tool message: the text is the answer, kept as it is
    text = HERMES["messages"][1]["content"]
    assert one({"messages": [U("q"), A(text)]}).messages[1].content == text


def test_content_part_lists_and_null_content_are_read_as_text():
    conv = one({"messages": [U([{"type": "text", "text": "q"}]), A(None, reasoning_content="r"), U("q2"), A("a")]})
    assert [m.content for m in conv.messages] == ["q", "", "q2", "a"]
    assert conv.conversions == (CONTENT_PARTS, CONTENT_NULL)


def test_input_output_pairs_are_a_conversation():
    conv = one(NEMOTRON)
    assert conv.system == "detailed thinking on" and conv.conversions == (INPUT_OUTPUT,)
    assert conv.messages == (Message(role="user", content="2+2?"), Message(role="assistant", content="4",
                                                                          reasoning="2+2=4"))
    assert one({"input": "q", "output": "a"}).messages == (Message(role="user", content="q"),
                                                          Message(role="assistant", content="a"))


def test_every_conversion_is_counted_in_prepare_stats(qwen3_tokenizer, tmp_path):
    from onepass.data.sources import load_conversations

    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (SHAREGPT_TOOLS, HERMES, NEMOTRON, NEMOTRON)))
    convs = load_conversations(path).conversations
    _, stats = prepare(convs, qwen3_tokenizer)
    assert stats.conversions == {SHAREGPT_CALL: 1, HERMES_CALL: 1, INPUT_OUTPUT: 2}
    assert stats.views_skipped == 0 and stats.views_trained == 6
    assert "read: 1 records inline <tool_call> JSON before a tool message -> tool_calls" in stats.summary()
