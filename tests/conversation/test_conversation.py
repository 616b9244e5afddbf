"""Readers and validation for conversation records, on small hand-written inputs."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onepass.conversation.parse import (
    Conversation,
    ConversationError,
    Message,
    ToolCall,
    parse_record,
    read_conversations,
    split_inline_reasoning,
)
from onepass.conversation.schemas import REASONING_KEYS
from onepass.render.messages import message_dict, template_messages, template_tools


def U(content):
    return {"role": "user", "content": content}


def A(content, **kw):
    return {"role": "assistant", "content": content, **kw}


def write(path, records, single=False):
    """Write ``records`` to ``path`` in the format its suffix names."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif path.suffix == ".json":
        path.write_text(json.dumps(records[0] if single else records))
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), path)
    return path


def one(record):
    return parse_record(record, source="d.jsonl", index=3)


# A tool-using record that exercises every field; its expected Conversation is below.
TOOL_RECORD = {
    "id": "conv-1",
    "messages": [
        {"role": "system", "content": "Be brief."},
        U("Weather in Paris?"),
        A("", reasoning_content="Need the tool.",
          tool_calls=[{"id": "c1", "type": "function",
                       "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]),
        {"role": "tool", "content": "18C", "tool_call_id": "c1"},
        A("18C and sunny.", reasoning_content=""),
    ],
}
TOOL_MESSAGES = (
    Message(role="user", content="Weather in Paris?"),
    Message(role="assistant", content="", reasoning="Need the tool.",
            tool_calls=(ToolCall(name="get_weather", arguments={"city": "Paris"}, id="c1", text='{"city": "Paris"}'),)),
    Message(role="tool", content="18C", tool_call_id="c1"),
    Message(role="assistant", content="18C and sunny.", reasoning=""),
)


# ---------------------------------------------------------------- file formats


@pytest.mark.parametrize("name,single,unit,first", [
    ("d.jsonl", False, "line", 1),
    ("d.json", False, "record", 0),
    ("d.json", True, "record", 0),
    ("d.parquet", False, "record", 0),
])
def test_every_format_reads_the_same_conversation(tmp_path, name, single, unit, first):
    path = write(tmp_path / name, [TOOL_RECORD, TOOL_RECORD], single=single)
    report = read_conversations(path)
    assert report.skipped == []
    assert len(report.conversations) == (1 if single else 2)
    c = report.conversations[0]
    assert c == Conversation(messages=TOOL_MESSAGES, system="Be brief.", id="conv-1",
                             source=f"{path} {unit} {first}", first_message=1)  # the system message is 0
    if not single:
        assert report.conversations[1].source == f"{path} {unit} {first + 1}"


def test_jsonl_blank_lines_are_skipped_but_keep_line_numbers(tmp_path):
    rec = {"messages": [U("q"), A("a")]}
    path = tmp_path / "d.jsonl"
    path.write_text(f"\n{json.dumps(rec)}\n\n{json.dumps(rec)}\n")
    assert [c.source for c in read_conversations(path).conversations] == [
        f"{path} line 2", f"{path} line 4"]


def test_parquet_sharegpt_and_interactions(tmp_path):
    path = write(tmp_path / "s.parquet", [
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a", "reasoning": "r"}]},
        {"conversations": [{"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2", "reasoning": None}]},
    ])
    a, b = read_conversations(path).conversations
    assert a.messages[1] == Message(role="assistant", content="a", reasoning="r")
    assert b.messages[1] == Message(role="assistant", content="a2", reasoning=None)


# ---------------------------------------------------------------- reasoning


@pytest.mark.parametrize("key", REASONING_KEYS)
def test_reasoning_from_each_field_name(key):
    c = one({"messages": [U("q"), A("a", **{key: "r"})]})
    assert c.messages[1] == Message(role="assistant", content="a", reasoning="r")


@pytest.mark.parametrize("content,reasoning,answer", [
    ("<think>r</think>a", "r", "a"),
    ("<think>\nr\n</think>\n\na", "r", "a"),
    ("<think>\nline 1\nline 2\n</think>\n\na\nb", "line 1\nline 2", "a\nb"),
    ("<think>\n\n</think>\n\na", "", "a"),
    ("r</think>a", "r", "a"),  # Qwen3: <think> already in the generation prompt
    ("plain answer", None, "plain answer"),
])
def test_inline_think_is_split_from_content(content, reasoning, answer):
    m = one({"messages": [U("q"), A(content)]}).messages[1]
    assert (m.reasoning, m.content) == (reasoning, answer)


def test_empty_reasoning_field_is_kept_as_empty_string_not_none():
    m = one({"messages": [U("q"), A("a", reasoning_content="")]}).messages[1]
    assert m.reasoning == ""


def test_empty_inline_think_with_a_reasoning_field_is_not_a_conflict():
    m = one({"messages": [U("q"), A("<think>\n\n</think>\n\na", reasoning="r")]}).messages[1]
    assert (m.reasoning, m.content) == ("r", "a")


def test_think_in_a_user_message_is_left_alone():
    assert one({"messages": [U("<think>x</think>q"), A("a")]}).messages[0].content == "<think>x</think>q"


@settings(max_examples=200, deadline=None)
@given(
    r=st.text().filter(lambda s: "<think>" not in s and "</think>" not in s).map(lambda s: s.strip("\n")),
    c=st.text().filter(lambda s: "</think>" not in s).map(lambda s: s.lstrip("\n")),
)
def test_split_inline_reasoning_round_trips(r, c):
    assert split_inline_reasoning(f"<think>\n{r}\n</think>\n\n{c}") == (r, c)


# ---------------------------------------------------------------- shapes


def test_system_prompt_as_first_message_or_field_is_the_same():
    as_message = one({"messages": [{"role": "system", "content": "S"}, U("q"), A("a")]})
    as_field = one({"system": "S", "messages": [U("q"), A("a")]})
    assert as_message.system == as_field.system == "S"
    assert as_message.messages == as_field.messages == (
        Message(role="user", content="q"), Message(role="assistant", content="a"))


def test_tools_list_is_kept():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    c = one({"tools": [tool], "messages": [U("q"), A("a")]})
    assert c.tools == (tool,)
    assert template_tools(c) == [tool]
    assert template_tools(one({"messages": [U("q"), A("a")]})) is None
    assert one({"tools": json.dumps([tool]), "messages": [U("q"), A("a")]}).tools == (tool,)


@pytest.mark.parametrize("call", [
    {"type": "function", "function": {"name": "f", "arguments": {"x": 1, "y": [2]}}},
    {"type": "function", "function": {"name": "f", "arguments": '{"x": 1, "y": [2]}'}},
    {"name": "f", "arguments": '{"x": 1, "y": [2]}'},  # flat form
])
def test_tool_call_arguments_dict_or_json_string(call):
    m = one({"messages": [U("q"), A(None, tool_calls=[call]), {"role": "tool", "content": "ok"}, A("done")]})
    given = call.get("function", call)["arguments"]
    assert m.messages[1] == Message(role="assistant", content="", tool_calls=(
        ToolCall(name="f", arguments={"x": 1, "y": [2]}, text=given if isinstance(given, str) else None),))


def test_empty_tool_call_arguments_string_is_empty_dict():
    m = one({"messages": [U("q"), A("", tool_calls=[{"function": {"name": "f", "arguments": ""}}])]})
    assert m.messages[1].tool_calls == (ToolCall(name="f", arguments={}),)


def test_sharegpt_roles():
    c = one({"conversations": [
        {"from": "system", "value": "S"},
        {"from": "human", "value": "q"},
        {"from": "gpt", "value": "a", "reasoning": "r"},
        {"from": "human", "value": "q2"},
        {"from": "gpt", "value": "<think>r2</think>a2"},
    ]})
    assert c.system == "S"
    assert c.messages == (
        Message(role="user", content="q"),
        Message(role="assistant", content="a", reasoning="r"),
        Message(role="user", content="q2"),
        Message(role="assistant", content="a2", reasoning="r2"),
    )


def test_interactions_shape():
    c = one({"interactions": [{"query": "q1", "think": "t1", "answer": "a1"},
                              {"query": "q2", "think": "", "answer": "a2"}]})
    assert c.system is None
    assert c.messages == (
        Message(role="user", content="q1"),
        Message(role="assistant", content="a1", reasoning="t1"),
        Message(role="user", content="q2"),
        Message(role="assistant", content="a2", reasoning=""),
    )
    assert c.num_assistant_turns == 2


def test_interactions_without_think_field_accept_inline_think():
    c = one({"interactions": [{"query": "q", "answer": "<think>r</think>a"}]})
    assert (c.messages[1].reasoning, c.messages[1].content) == ("r", "a")


# ---------------------------------------------------------------- templates


def test_template_messages_are_what_hf_chat_templates_expect():
    c = parse_record(TOOL_RECORD)
    assert template_messages(c) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
         "tool_calls": [{"type": "function", "id": "c1",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18C", "tool_call_id": "c1"},
        {"role": "assistant", "content": "18C and sunny.", "reasoning_content": ""},
    ]
    assert template_messages(c, upto=1) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]


def test_kimi_tool_ids_name_the_tool_count_every_call_and_follow_to_the_result():
    """functions.NAME:IDX, IDX over the whole conversation; each result gets its call's new id, by the old
    id or, without one, in order (the Kimi-K2 templates render a call and its result by these ids)."""
    record = {"messages": [U("q"), A("", tool_calls=[{"id": "x", "function": {"name": "f", "arguments": "{}"}},
                                                    {"function": {"name": "g", "arguments": "{}"}}]),
                           {"role": "tool", "content": "2", "tool_call_id": "x"}, {"role": "tool", "content": "3"},
                           A("", tool_calls=[{"id": "x9", "function": {"name": "f", "arguments": "{}"}}]),
                           {"role": "tool", "content": "4", "tool_call_id": "x9"}, A("done")]}
    got = template_messages(one(record), tool_ids="functions")
    assert [[c["id"] for c in m["tool_calls"]] for m in got if "tool_calls" in m] == [
        ["functions.f:0", "functions.g:1"], ["functions.f:2"]]
    assert [m["tool_call_id"] for m in got if m["role"] == "tool"] == ["functions.f:0", "functions.g:1", "functions.f:2"]
    assert template_messages(one(record))[2]["tool_call_id"] == "x"  # the record's ids by default


def test_message_dict_omits_absent_fields():
    assert message_dict(Message(role="assistant", content="a")) == {"role": "assistant", "content": "a"}
    # reasoning on a non-assistant message never reaches the template
    assert message_dict(Message(role="user", content="q", reasoning="x")) == {"role": "user", "content": "q"}
    no_system = one({"messages": [U("q"), A("a", reasoning="r")]})
    assert template_messages(no_system) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": "r"},
    ]


# ---------------------------------------------------------------- errors

TOOL_CALL = [{"function": {"name": "f", "arguments": "{}"}}]

BAD_RECORDS = [
    ({"messages": []}, None, "the conversation is empty"),
    ({"messages": [U("q")]}, None, "no assistant turn"),
    ({"messages": [U("q"), {"role": "bot", "content": "a"}]}, 1, "unknown role 'bot'"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "robot", "value": "a"}]}, 1,
     "unknown speaker 'robot'"),
    ({"messages": [U("q"), A(5)]}, 1, "content must be a string, got int"),
    ({"messages": [U("q"), A(["a"])]}, 1, "content is a list of 1 OpenAI content parts (str)"),
    ({"messages": [U("q"), A([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])]}, 1,
     "content is a list of 2 OpenAI content parts (text, text): onepass reads a string or a list of one text part"),
    ({"messages": [U([{"type": "image_url", "image_url": {"url": "x"}}]), A("a")]}, 0,
     "content is a list of 1 OpenAI content parts (image_url)"),
    ({"messages": [U("q"), A("a", weight=0.5)]}, 1, "weight must be 0 or 1 (OpenAI fine-tuning format), got 0.5"),
    ({"messages": [U("q", ) | {"weight": 1}, A("a")]}, 0, "weight 1 on a user message"),
    ({"messages": [U("q"), A("<think>cut off")]}, 1, "unclosed <think> at the start of the content"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "f(1)"}]}, 1,
     "a function_call turn's value is not valid JSON"),
    ({"messages": [U("q"), A("<tool_call>\n{oops}\n</tool_call>"), {"role": "tool", "content": "1"}, A("a")]}, 1,
     "inline <tool_call> block 0 is not valid JSON"),
    ({"messages": [U("q"), A('<tool_call>{"name": "f", "arguments": {}}</tool_call> then'),
                   {"role": "tool", "content": "1"}, A("a")]}, 1,
     "inline <tool_call> blocks with text between or after them before a tool message"),
    ({"instruction": "do", "input": "", "output": "done"}, None,
     "an Alpaca instruction/input/output record (keys input, instruction, output), not a conversation; the nearest"),
    ({"input": 3, "output": "a"}, None, "'input' must be a list of messages or a string, got int"),
    ({"messages": [U("q"), A("a", reasoning=["r"])]}, 1, "reasoning must be a string, got list"),
    ({"messages": [U("q"), {"role": "tool", "content": "x"}, A("a")]}, 1,
     "tool message without a preceding assistant tool call"),
    ({"messages": [U("q") | {"tool_calls": [{"function": {"name": "f", "arguments": {}}}]}, A("a")]}, 0,
     "tool_calls on a user message: chat templates render an assistant's calls only"),
    ({"messages": [U("q"), A("a"), A("b")]}, 2, "two assistant messages in a row"),
    ({"messages": [U("q"), A("a"), {"role": "system", "content": "S"}, A("b")]}, 2,
     "a system message is only allowed first"),
    ({"messages": [U("q"), A("", tool_calls=[{"function": {"name": "f", "arguments": "{oops"}}])]}, 1,
     "tool_calls[0].function.arguments is not valid JSON"),
    ({"messages": [U("q"), A("", tool_calls=[{"function": {"arguments": "{}"}}])]}, 1,
     "tool_calls[0] has no function name"),
    ({"system": "S", "messages": [{"role": "system", "content": "T"}, U("q"), A("a")]}, None,
     "system prompt given both as a field and as the first message"),
    ([U("q"), A("a")], None, "a record must be a JSON object, got list"),
    ({"prompt": "q", "completion": "a"}, None,
     "a prompt/completion record (keys completion, prompt), not a conversation; the nearest supported schema: "
     "'messages'"),
    ({"query": "q", "response": "a"}, None,
     "no 'messages', 'conversations', 'interactions' or 'input'/'output' field; keys are query, response"),
    ({"messages": "q"}, None, "the messages must be a list, got str"),
    ({"interactions": [{"query": "q"}]}, 0, "an interaction must be an object with 'query', 'answer'"),
    ({"tools": "{oops", "messages": [U("q"), A("a")]}, None, "'tools' is a string that is not valid JSON"),
]


@pytest.mark.parametrize("record,message,why", BAD_RECORDS)
def test_errors_name_file_line_and_message(tmp_path, record, message, why):
    path = write(tmp_path / "d.jsonl", [{"messages": [U("ok"), A("ok")]}, record])
    where = f"{path} line 2" + (f", message {message}" if message is not None else "")
    with pytest.raises(ConversationError) as e:
        read_conversations(path)
    assert str(e.value).startswith(f"{where}: {why}"), str(e.value)


def test_errors_in_json_files_name_the_record_index(tmp_path):
    path = write(tmp_path / "d.json", [{"messages": [U("q"), A("a")]}, {"messages": [U("q"), A("a"), A("b")]}])
    with pytest.raises(ConversationError, match=r"d\.json record 1, message 2: two assistant"):
        read_conversations(path)


def test_error_message_index_counts_the_system_message():
    rec = {"messages": [{"role": "system", "content": "S"}, U("q"), A("a"), A("b")]}
    with pytest.raises(ConversationError, match=r"record 3, message 3: two assistant"):
        one(rec)


def test_invalid_json_line_names_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": [U("q"), A("a")]}) + "\n{oops\n")
    with pytest.raises(ConversationError, match="^" + re.escape(f"{path} line 2: not valid JSON")):
        read_conversations(path)


def test_invalid_json_file_and_wrong_top_level(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[{")
    with pytest.raises(ConversationError, match="^" + re.escape(f"{bad}: not valid JSON")):
        read_conversations(bad)
    scalar = tmp_path / "scalar.json"
    scalar.write_text("3")
    with pytest.raises(ConversationError, match="expected a list of records or one record"):
        read_conversations(scalar)


def test_unsupported_suffix(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("messages\n")
    with pytest.raises(ConversationError, match=r"unsupported file type '\.csv'; use \.jsonl, \.json or \.parquet"):
        read_conversations(path)


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=re.escape(str(path))):
        read_conversations(path)


# ---------------------------------------------------------------- strict / lenient / limit

MIXED = [
    {"messages": [U("q1"), A("a1")]},
    {"messages": [U("q2")]},
    {"messages": [U("q3"), A("a3")]},
    {"messages": [U("q4"), {"role": "bot", "content": "a4"}]},
    {"messages": [U("q5"), A("a5")]},
]


def test_lenient_read_keeps_good_records_and_counts_skipped_ones(tmp_path):
    path = write(tmp_path / "d.jsonl", MIXED)
    report = read_conversations(path, strict=False)
    assert [c.messages[0].content for c in report.conversations] == ["q1", "q3", "q5"]
    assert report.skipped == [
        f"{path} line 2: no assistant turn: nothing to train",
        f"{path} line 4, message 1: unknown role 'bot'; expected one of system, developer, user, assistant, tool",
    ]


def test_strict_read_raises_at_the_first_bad_record(tmp_path):
    path = write(tmp_path / "d.jsonl", MIXED)
    with pytest.raises(ConversationError, match="^" + re.escape(f"{path} line 2: no assistant turn")):
        read_conversations(path, strict=True)


@pytest.mark.parametrize("limit,strict,kept,num_skipped", [
    (0, True, [], 0),
    (1, True, ["q1"], 0),
    (2, False, ["q1", "q3"], 1),
    (10, False, ["q1", "q3", "q5"], 2),
])
def test_limit_counts_kept_conversations(tmp_path, limit, strict, kept, num_skipped):
    path = write(tmp_path / "d.jsonl", MIXED)
    report = read_conversations(path, strict=strict, limit=limit)
    assert [c.messages[0].content for c in report.conversations] == kept
    assert len(report.skipped) == num_skipped


def test_limit_stops_before_reading_further_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(MIXED[0]) + "\n{truncated\n")
    assert len(read_conversations(path, limit=1).conversations) == 1


def test_lenient_read_skips_an_invalid_json_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(MIXED[0]) + "\n{truncated\n" + json.dumps(MIXED[2]) + "\n")
    report = read_conversations(path, strict=False)
    assert [c.messages[0].content for c in report.conversations] == ["q1", "q3"]
    assert len(report.skipped) == 1 and report.skipped[0].startswith(f"{path} line 2: not valid JSON")
