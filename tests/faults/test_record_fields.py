"""A record's fields are read or refused by name, never dropped (issue 37, round 3, data side).

Before: a reasoning field under a name onepass does not read (``thought``, a misspelled key) trained the
turn as ``<think>\\n\\n</think>\\n\\nanswer`` (an answer without reasoning), nothing counted; a ``system``
given as content parts, a message, a number, or ``null`` beside ``system_prompt`` was dropped; a
``functions`` list beside the messages was never rendered; JSON nested deep aborted a lenient run with a
``RecursionError``. Now each is read (and counted where it is a conversion), or the record is refused in
one line naming the field (a counted skip under a lenient read, an error under ``--strict``), as the RL
reader refuses an unknown turn field.
"""

from __future__ import annotations

import json

import pytest

from onepass.cli import main
from onepass.conversation.parse import ConversationError, parse_record
from onepass.data.sources import load_conversations

Q = {"role": "user", "content": "2+2?"}
GOOD = {"messages": [Q, {"role": "assistant", "content": "4"}]}


def _one(record):
    return parse_record(record, source="d.jsonl", index=2, unit="line")


def _jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


@pytest.mark.parametrize("key,hint", [
    ("thought", "did you mean reasoning_content?"),
    ("reasoning_contnet", "did you mean reasoning_content?"),
    ("Thinking", "did you mean reasoning_content?"),
    ("function_call", "OpenAI's legacy function_call: give it as tool_calls"),
    ("contnet", "did you mean content?"),
])
def test_an_unknown_message_field_is_refused_by_name_with_a_hint(key, hint):
    record = {"messages": [Q, {"role": "assistant", "content": "4", key: "2+2=4"}]}
    with pytest.raises(ConversationError) as e:
        _one(record)
    assert str(e.value).startswith(f"d.jsonl line 2, message 1: unknown field {key!r} ({hint}")


def test_a_lenient_read_counts_the_record_and_strict_stops(tmp_path, capsys):
    bad = {"messages": [Q, {"role": "assistant", "content": "4", "thought": "2+2=4"}]}
    data = _jsonl(tmp_path / "chats.jsonl", [GOOD, bad, GOOD])
    report = load_conversations(str(data), strict=False)
    assert len(report.conversations) == 2
    assert report.skipped == [f"{data} line 2, message 1: unknown field 'thought' (did you mean reasoning_content? "
                              "onepass reads reasoning from reasoning_content, reasoning, thinking); onepass reads "
                              "content, name, reasoning, reasoning_content, role, thinking, tool_call_id, tool_calls, "
                              "tools, weight: rename or remove it (a template may render it at inference, so onepass "
                              "will not drop it)"]
    assert main(["prepare", "--data", str(data), "--no-progress", "--out", str(tmp_path / "o")]) == 0
    stats = json.loads((tmp_path / "o" / "stats.json").read_text())
    assert stats["skipped_by_reason"] == {"invalid record": 1} and "unknown field 'thought'" in stats["skipped"][0]
    assert main(["prepare", "--data", str(data), "--no-progress", "--strict", "--out", str(tmp_path / "s")]) == 2
    assert "line 2, message 1: unknown field 'thought'" in capsys.readouterr().err


def test_fields_that_hold_nothing_are_not_refused():
    # an OpenAI export's refusal: null / annotations: [], or a parquet column of another record's field
    record = {"messages": [Q, {"role": "assistant", "content": "4", "refusal": None, "annotations": [],
                               "thought": ""}]}
    assert _one(record).messages[1].content == "4"


@pytest.mark.parametrize("schema", ["sharegpt", "interactions"])
def test_other_schemas_refuse_unknown_fields_too(schema):
    record = ({"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4", "thought": "r"}]}
              if schema == "sharegpt" else
              {"interactions": [{"query": "2+2?", "answer": "4", "thought": "r"}]})
    with pytest.raises(ConversationError, match=r"d.jsonl line 2, message [01]: unknown field 'thought' \(did you mean"):
        _one(record)


@pytest.mark.parametrize("key", ["functions", "tool"])
def test_a_tool_list_under_a_name_onepass_does_not_read_is_refused(key):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    with pytest.raises(ConversationError, match=f"d.jsonl line 2: unknown record field '{key}' \\(did you mean tools"):
        _one({**GOOD, key: tools})
    assert _one({**GOOD, "id": "x", "source": "s", "domain": "airline"}).id == "x"  # metadata fields are fine


# ------------------------------------------------------------------ every form of the system prompt


@pytest.mark.parametrize("record,system", [
    ({"system": [{"type": "text", "text": "Be brief."}], **GOOD}, "Be brief."),
    ({"system": {"role": "system", "content": "Be brief."}, **GOOD}, "Be brief."),
    ({"system": None, "system_prompt": "Be brief.", **GOOD}, "Be brief."),
    ({"system": "", "system_prompt": "Be brief.", **GOOD}, "Be brief."),
    ({"system": "Be brief.", "system_prompt": "Be brief.", **GOOD}, "Be brief."),
    ({"system": {"role": "developer", "content": "Be brief."}, **GOOD}, "Be brief."),
])
def test_every_form_of_system_we_accept_is_read(record, system, qwen3_tokenizer):
    from onepass.render import render_conversation

    conv = _one(record)
    assert conv.system == system
    (view,) = render_conversation(conv, qwen3_tokenizer).views
    assert "Be brief." in qwen3_tokenizer.decode(view.tokens[:view.num_prompt])


@pytest.mark.parametrize("record,why", [
    ({"system": 3, **GOOD}, "'system' must be a string, a list of one text part or a system message, got int 3"),
    ({"system": True, **GOOD}, "'system' must be a string, a list of one text part or a system message, got bool"),
    ({"system_prompt": ["a"], **GOOD}, "'system_prompt' is a list of 1 OpenAI content parts"),
    ({"system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], **GOOD},
     "'system' is a list of 2 OpenAI content parts"),
    ({"system": "A", "system_prompt": "B", **GOOD}, "'system' and 'system_prompt' hold different text"),
    ({"system": {"role": "user", "content": "A"}, **GOOD}, "'system' is a 'user' message"),
    ({"system": {"content": "A", "cache": 1}, **GOOD}, "unknown field of 'system' 'cache'"),
])
def test_any_other_system_is_one_line(record, why):
    with pytest.raises(ConversationError) as e:
        _one(record)
    assert str(e.value).startswith(f"d.jsonl line 2: {why}"), str(e.value)


# ------------------------------------------------------------------ JSON nested deep


DEEP = "[" * 100_000 + "]" * 100_000


def _call(arguments):
    return {"messages": [Q, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "content": "x"}, {"role": "assistant", "content": "4"}]}


@pytest.mark.parametrize("depth", [900, 100_000])
def test_deeply_nested_json_string_arguments_are_a_counted_skip(tmp_path, depth):
    nested = "[" * depth + "]" * depth
    data = _jsonl(tmp_path / "chats.jsonl", [GOOD, _call('{"a": ' + nested + '}'), GOOD])
    report = load_conversations(str(data), strict=False)
    assert len(report.conversations) == 2
    assert report.skipped == [f"{data} line 2, message 1: tool_calls[0].function.arguments is JSON nested more than "
                              "100 levels deep (chat templates and transformers copy and print it one level at a "
                              "time)"]


def test_a_record_nested_900_deep_is_a_counted_skip_not_a_crash_in_the_template(tmp_path):
    # valid JSON the reader takes (under Python's ~1,000 levels), then transformers copies the message
    # one frame a level: a RecursionError traceback killed the run before
    nested = "[" * 900 + "]" * 900
    deep = '{"messages": [%s, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": ' \
           '{"name": "f", "arguments": {"a": %s}}}]}, {"role": "tool", "content": "x"}, ' \
           '{"role": "assistant", "content": "4"}]}' % (json.dumps(Q), nested)
    data = _jsonl(tmp_path / "chats.jsonl", [GOOD, deep, GOOD])
    assert main(["prepare", "--data", str(data), "--no-progress", "--out", str(tmp_path / "o")]) == 0
    stats = json.loads((tmp_path / "o" / "stats.json").read_text())
    assert stats["conversations"] == 2 and stats["skipped_by_reason"] == {"invalid record": 1}
    assert stats["skipped"] == [f"{data} line 2, message 1: nested more than 100 levels deep (chat templates and "
                                "transformers copy and print a message one level at a time)"]


# ------------------------------------------------------------------ messages after the last assistant turn


def test_messages_after_the_last_assistant_turn_are_counted_and_reported(tmp_path, capsys):
    # 200 of 200 tau-bench records end after their last assistant turn (149 with the user's last word, 51 with
    # the last tool call's result): those messages are in no view; before, no counter of stats.json said so
    ends_with_user = {"messages": [*GOOD["messages"], {"role": "user", "content": "thanks, bye"}]}
    data = _jsonl(tmp_path / "chats.jsonl", [GOOD, ends_with_user, ends_with_user])
    assert main(["prepare", "--data", str(data), "--no-progress", "--out", str(tmp_path / "o")]) == 0
    stats = json.loads((tmp_path / "o" / "stats.json").read_text())
    name = "messages after the last assistant turn -> in no view (never trained)"
    assert stats["conversions"] == {name: 2}
    assert f"read: 2 records {name}" in capsys.readouterr().out


# ------------------------------------------------------------------ values JSON or a template would change


@pytest.mark.parametrize("line,why", [
    ('{"messages": [{"role": "user", "content": "a", "content": "b"}, {"role": "assistant", "content": "4"}]}',
     "line 2: key 'content' appears twice in one object (JSON keeps only the last)"),
    (json.dumps(_call('{"x": 1, "x": 2}')),
     "line 2, message 1: tool_calls[0].function.arguments: key 'x' appears twice in one object"),
    (json.dumps(_call('{"x": NaN}')), "line 2, message 1: tool_calls[0].function.arguments: NaN is not JSON"),
    (json.dumps(_call('{"x": 1e999}')),
     "line 2, message 1: tool_calls[0].function.arguments: the number 1e999 is past a float's range"),
    (json.dumps(_call({"x": 1})).replace('"x": 1', '"x": Infinity'),
     "line 2, message 1: tool_calls[0].function.arguments holds inf, not a JSON number"),
    (json.dumps({"messages": [Q, {"role": "assistant", "content": "4", "name": 7}]}),
     "line 2, message 1: name must be a string, got int 7"),
    (json.dumps({"messages": [Q, {"role": "assistant", "content": "", "tool_calls": [
        {"id": 12, "type": "function", "function": {"name": "f", "arguments": {}}}]},
        {"role": "tool", "content": "x", "tool_call_id": 12}, {"role": "assistant", "content": "4"}]}),
     "line 2, message 1: tool_calls[0].id must be a string, got int 12"),
    (json.dumps({"messages": [Q, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "custom", "custom": {"name": "f", "input": "x"}}]}, {"role": "tool", "content": "x"},
        {"role": "assistant", "content": "4"}]}),
     "line 2, message 1: tool_calls[0] is of type 'custom'; onepass reads function calls"),
])
def test_values_json_or_a_template_would_change_are_one_line(tmp_path, line, why):
    # before: the first of two keys dropped, NaN / 1e999 / Infinity rendered as NaN or Infinity by tojson (and
    # a JSON-string argument re-serialised without its duplicate), a number name or id dropped, a custom
    # tool call rendered as a function call
    data = _jsonl(tmp_path / "chats.jsonl", [GOOD, line, GOOD])
    report = load_conversations(str(data), strict=False)
    assert len(report.conversations) == 2 and len(report.skipped) == 1, report.skipped
    assert report.skipped[0].startswith(f"{data} {why}"), report.skipped[0]
