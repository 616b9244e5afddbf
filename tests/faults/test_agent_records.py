"""Real agent data as recorded (issue 44, items 11 and 12): tau2-bench trajectories and tools that appear mid-way.

Item 11. Every tau2-bench text simulation opens with the agent's fixed greeting ("Hi! How can I help you today?",
written by its orchestrator before the user speaks) and saves its messages as its pydantic models dump them:
tool calls ``{"id", "name", "arguments", "requestor"}``, results with their call's ``id``, bookkeeping
(``turn_idx``, ``timestamp``, ``cost``, ...) on every message, and, in telecom, the user simulator's own tool calls.
Before: ``prepare`` skipped 199 of 200 such records ("the first message must be from the user, got 'assistant'")
while the Qwen3, gpt-oss and Qwen3.6 templates all render them. Now the record is read as the agent was sent it
(tau2-bench's ``to_litellm_messages``), every view is the template's own rendering of those messages, token by token;
the greeting (it answers no user turn) is context, counted, and trained only with ``train_greeting``, where the
template renders it (Qwen3.6's raises "no user query" for a system prompt alone: a counted skip).

The records below are hand-written in the shape of tau2-bench's saved simulations (sierra-research/tau2-bench,
``src/tau2/data_model/message.py`` and ``src/tau2/orchestrator/orchestrator.py`` at commit a2c0247; no code or data
copied), with an airline-like tool. The templates are Qwen3, gpt-oss and Qwen3.6 from
``../shared/fixtures/chat_templates/`` (byte-identical copies are vendored in ``tests/fixtures/chat_templates``, used
where ``../shared`` is not beside the tree, as in ``tests/faults/old_main.sh``'s temporary copy).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from onepass.conversation.parse import parse_record
from onepass.errors import ConversationError
from onepass.prepare.pipeline import PrepareConfig, prepare
from onepass.render import RenderConfig, render_conversation

VENDORED = Path(__file__).parents[1] / "fixtures" / "chat_templates"
SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "chat_templates"
TEMPLATES = {"qwen3": "qwen3.jinja", "gptoss": "reasoning/gptoss.jinja", "qwen3_6": "reasoning/qwen3_6.jinja"}
GREETING = "Hi! How can I help you today?"
TOOLS = [{"type": "function", "function": {
    "name": "get_reservation_details", "description": "Get the details of a reservation.",
    "parameters": {"type": "object", "properties": {"reservation_id": {"type": "string",
                                                                       "description": "The reservation ID."}},
                   "required": ["reservation_id"]}}}]


def _logged(turn: int, **message) -> dict:
    """A participant message as tau2-bench saves it: the message and its bookkeeping (text mode: no audio)."""
    return {**message, "is_audio": False, "turn_idx": turn, "timestamp": f"2025-06-01T10:00:{turn:02d}.000000",
            "cost": 0.0012 * turn, "usage": {"prompt_tokens": 100 + turn} if turn else None, "raw_data": None,
            "generation_time_seconds": None, "context_truncation": None, "audio_format": None, "audio_path": None,
            "audio_script_gold": None, "speech_effects": None, "source_effects": None, "channel_effects": None,
            "turn_taking_action": None, "utterance_ids": None, "chunk_id": None, "is_final_chunk": True,
            "source": None, "contains_speech": True}


def _result(turn: int, call_id: str, content: str, *, requestor: str = "assistant") -> dict:
    return {"id": call_id, "role": "tool", "content": content, "requestor": requestor, "error": False,
            "turn_idx": turn, "timestamp": f"2025-06-01T10:00:{turn:02d}.500000"}


def tau2_record() -> dict:
    """An airline simulation: greeting, a call and its result, an answer, a second request, the user's stop."""
    return {"id": "airline-task-7-trial-0", "system": "<instructions>\nYou are a customer service agent.\n"
                                                      "</instructions>\n<policy>\nBe precise.\n</policy>",
            "tools": TOOLS, "messages": [
                _logged(0, role="assistant", content=GREETING, tool_calls=None),
                _logged(1, role="user", content="Hi, can you check reservation ZFA04Y?", tool_calls=None),
                _logged(2, role="assistant", content=None, tool_calls=[{
                    "id": "call_a1", "name": "get_reservation_details", "arguments": {"reservation_id": "ZFA04Y"},
                    "requestor": "assistant"}]),
                _result(3, "call_a1", '{"reservation_id": "ZFA04Y", "status": "active"}'),
                _logged(4, role="assistant", content="Reservation ZFA04Y is active.", tool_calls=None),
                _logged(5, role="user", content="And 8JX2WO?", tool_calls=None),
                _logged(6, role="assistant", content=None, tool_calls=[{
                    "id": "call_a2", "name": "get_reservation_details", "arguments": {"reservation_id": "8JX2WO"},
                    "requestor": "assistant"}]),
                {**_result(7, "call_a2", "Error: Reservation 8JX2WO not found"), "error": True},
                _logged(8, role="assistant", content="I could not find reservation 8JX2WO.", tool_calls=None),
                _logged(9, role="user", content="Thanks. ###STOP###", tool_calls=None)]}


def sent_messages() -> list[dict]:
    """What tau2-bench's agent was sent for :func:`tau2_record` (its ``to_litellm_messages``, written by hand):
    the reference every view is compared with."""
    def call(i, rid):
        return [{"id": f"call_a{i}", "type": "function",
                 "function": {"name": "get_reservation_details", "arguments": {"reservation_id": rid}}}]
    return [{"role": "system", "content": tau2_record()["system"]},
            {"role": "assistant", "content": GREETING},
            {"role": "user", "content": "Hi, can you check reservation ZFA04Y?"},
            {"role": "assistant", "content": None, "tool_calls": call(1, "ZFA04Y")},
            {"role": "tool", "content": '{"reservation_id": "ZFA04Y", "status": "active"}', "tool_call_id": "call_a1"},
            {"role": "assistant", "content": "Reservation ZFA04Y is active."},
            {"role": "user", "content": "And 8JX2WO?"},
            {"role": "assistant", "content": None, "tool_calls": call(2, "8JX2WO")},
            {"role": "tool", "content": "Error: Reservation 8JX2WO not found", "tool_call_id": "call_a2"},
            {"role": "assistant", "content": "I could not find reservation 8JX2WO."},
            {"role": "user", "content": "Thanks. ###STOP###"}]


@pytest.fixture
def template(with_template):
    def use(name: str):
        path = SHARED / TEMPLATES[name]
        return with_template((path if path.is_file() else VENDORED / Path(TEMPLATES[name]).name).read_text("utf-8"))
    return use


def _assert_views_are_the_templates_rendering(tok, views, messages, tools, *, head=1):
    """Each view: prompt = template(messages up to the turn, generation prompt), completion = the rest of the
    template's rendering with the turn, both as the tokenizer encodes them (Qwen3.6 and gpt-oss render a
    finished conversation's last turn as the model generates it). ``head``: system messages before the turns."""
    def encode(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    for view in views:
        upto = head + view.turn
        prompt = tok.apply_chat_template(messages[:upto], tools=tools, tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(messages[:upto + 1], tools=tools, tokenize=False)
        assert full.startswith(prompt)
        assert view.tokens[:view.num_prompt].tolist() == encode(prompt)
        assert view.tokens[view.num_prompt:].tolist() == encode(full[len(prompt):])


def openai_record() -> dict:
    """The same conversation as OpenAI messages (what the agent was sent; a tau2-bench export in that shape): the
    record the issue's tester gave, refused for its first message."""
    return {"tools": TOOLS, "messages": sent_messages()}


@pytest.mark.parametrize("shape", [tau2_record, openai_record], ids=["as-recorded", "openai-messages"])
@pytest.mark.parametrize("name", list(TEMPLATES))
def test_a_tau2_bench_simulation_trains_every_turn_after_the_greeting(template, name, shape):
    tok = template(name)
    conv = parse_record(shape(), source="airline.jsonl", index=1, unit="line")
    rendered = render_conversation(conv, tok)
    assert not rendered.skipped, [str(e) for e in rendered.skipped]
    assert [v.turn for v in rendered.views] == [2, 4, 6, 8]  # every assistant turn but the greeting (0)
    assert rendered.greeting_not_trained == 1
    _assert_views_are_the_templates_rendering(tok, rendered.views, sent_messages(), TOOLS)


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_the_greeting_is_trained_only_when_asked_and_where_the_template_renders_it(template, name):
    tok = template(name)
    conv = parse_record(tau2_record(), source="airline.jsonl", index=1, unit="line")
    rendered = render_conversation(conv, tok, RenderConfig(train_greeting=True))
    assert rendered.greeting_not_trained == 0
    if name == "qwen3_6":  # raises "No user query found in messages." for the system prompt alone
        assert [v.turn for v in rendered.views] == [2, 4, 6, 8]
        (error,) = rendered.skipped
        assert str(error).startswith("airline.jsonl line 1, message 0: the chat template raised")
        assert "No user query found" in str(error)
    else:
        assert not rendered.skipped and [v.turn for v in rendered.views] == [0, 2, 4, 6, 8]
    _assert_views_are_the_templates_rendering(tok, rendered.views, sent_messages(), TOOLS)


def test_prepare_keeps_every_tau2_record_and_counts_the_greetings(qwen3_tokenizer, tmp_path):
    records = [tau2_record() for _ in range(3)]
    convs = [parse_record(r, source="airline.jsonl", index=i, unit="line") for i, r in enumerate(records)]
    rows, stats = prepare(convs, qwen3_tokenizer, PrepareConfig())
    assert (stats.conversations_used, stats.views_trained, stats.views_skipped) == (3, 12, 0)
    greeting = "assistant message opening the conversation (a greeting) -> context only, not trained (--train-greeting)"
    assert stats.conversions[greeting] == 3
    assert "3 records assistant message opening the conversation (a greeting)" in stats.summary()
    _, trained = prepare(convs, qwen3_tokenizer, PrepareConfig(train_greeting=True))
    assert trained.views_trained == 15 and greeting not in trained.conversions


def test_the_user_simulators_own_tool_calls_are_not_in_the_agents_conversation(qwen3_tokenizer):
    """telecom: the user toggles their phone's airplane mode; the call and its result go to the user's side."""
    record = tau2_record()
    user_side = [_logged(5, role="user", content=None, tool_calls=[{
                     "id": "call_u1", "name": "toggle_airplane_mode", "arguments": {}, "requestor": "user"}]),
                 _result(6, "call_u1", "Airplane mode: OFF", requestor="user"),
                 _logged(7, role="user", content="Done, airplane mode is off. And 8JX2WO?", tool_calls=None)]
    record["messages"] = record["messages"][:5] + user_side + record["messages"][6:]
    conv = parse_record(record, source="telecom.jsonl", index=1, unit="line")
    assert [m.role for m in conv.messages] == [m["role"] for m in sent_messages()[1:]]
    assert conv.messages[5].content == "Done, airplane mode is off. And 8JX2WO?"
    assert "tau2-bench user-side tool calls and results -> left out (the agent never saw them)" in conv.conversions
    rendered = render_conversation(conv, qwen3_tokenizer)
    assert [v.turn for v in rendered.views] == [2, 4, 6, 8] and not rendered.skipped
    assert "airplane" in qwen3_tokenizer.decode(rendered.views[-1].tokens)
    assert "toggle_airplane_mode" not in qwen3_tokenizer.decode(rendered.views[-1].tokens)


@pytest.mark.parametrize(("change", "why"), [
    ({"is_audio": True}, "'is_audio' is True: a voice or streaming message"),
    ({"context_truncation": {"messages_dropped": 4}}, "the agent saw a truncated history"),
    ({"chunk_id": 3}, "'chunk_id' is 3: a voice or streaming message"),
    ({"turn_summary": "x"}, "unknown field 'turn_summary'"),
])
def test_what_would_train_another_text_than_the_agent_saw_is_refused_naming_the_message(change, why):
    record = tau2_record()
    record["messages"][4].update(change)
    with pytest.raises(ConversationError) as e:
        parse_record(record, source="airline.jsonl", index=1, unit="line")
    assert str(e.value).startswith("airline.jsonl line 1, message 4: ") and why in str(e.value), str(e.value)



# --- item 12: tools that appear mid-conversation -------------------------------------------------------------------
# BFCL's multi_turn_miss_func (ShishirPatil/gorilla, berkeley-function-call-leaderboard): a function is held out of
# the tool list until the turn ``missed_function`` names; there its handler extends the list, compiles the tools
# again and sends "I have updated some more functions you can choose from. What about now?" (base_handler.py,
# default_prompts.py at commit 6ea5797). Every later step renders the whole conversation with the longer list.
# A record says so with ``tools`` on the message where the list changes: the full list from that message on.

def _fn(name: str, description: str, *params: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {p: {"type": "string"} for p in params}, "required": list(params)}}}


LS, CD, SORT = _fn("ls", "List the files of the current directory."), _fn("cd", "Change directory.", "folder"), \
    _fn("sort", "Sort the lines of a file.", "file_name")
UPDATED = "I have updated some more functions you can choose from. What about now?"


def _call(i: int, name: str, arguments: dict) -> list[dict]:
    return [{"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}]


def miss_func_record(topic: str = "report") -> dict:
    """A miss_func conversation: ``sort`` is missing until message 8, where the user message carries the new list."""
    return {"id": f"bfcl-multi_turn_miss_func-{topic}", "tools": [LS, CD], "messages": [
        {"role": "user", "content": f"Go to documents and list the {topic} files."},
        {"role": "assistant", "content": None, "tool_calls": _call(0, "cd", {"folder": "documents"})},
        {"role": "tool", "tool_call_id": "call_0", "content": '{"current_working_directory": "documents"}'},
        {"role": "assistant", "content": None, "tool_calls": _call(1, "ls", {})},
        {"role": "tool", "tool_call_id": "call_1", "content": f'{{"current_directory_content": ["{topic}.txt"]}}'},
        {"role": "assistant", "content": f"documents holds {topic}.txt."},
        {"role": "user", "content": f"Sort {topic}.txt by line."},
        {"role": "assistant", "content": "None of my functions sorts a file."},
        {"role": "user", "content": UPDATED, "tools": [LS, CD, SORT]},
        {"role": "assistant", "content": None, "tool_calls": _call(2, "sort", {"file_name": f"{topic}.txt"})},
        {"role": "tool", "tool_call_id": "call_2", "content": '{"sorted_content": "a\\nb"}'},
        {"role": "assistant", "content": f"{topic}.txt is sorted."}]}


def _tools_seen(record: dict, k: int) -> list[dict]:
    """The reference: the list BFCL's handler holds when it asks for message ``k``."""
    return next((m["tools"] for m in reversed(record["messages"][:k + 1]) if "tools" in m), record["tools"])


def _plain(record: dict) -> list[dict]:
    return [{k: v for k, v in m.items() if k != "tools"} for m in record["messages"]]


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_each_view_is_rendered_with_the_tools_its_turn_saw(template, name):
    tok = template(name)
    record = miss_func_record()
    conv = parse_record(record, source="miss_func.jsonl", index=1, unit="line")
    rendered = render_conversation(conv, tok)
    assert not rendered.skipped and [v.turn for v in rendered.views] == [1, 3, 5, 7, 9, 11]
    for view in rendered.views:
        tools = _tools_seen(record, view.turn)
        assert ("sort" in json.dumps(tools)) == (view.turn >= 8)
        _assert_views_are_the_templates_rendering(tok, [view], _plain(record), tools, head=0)


def _reference_terms(tok, records: list[dict]) -> dict:
    """(context tokens, target) -> weight of every view as the template renders it with its turn's tools, each
    encoded on its own (prompt, then completion): N-pass, written without onepass's renderer."""
    def encode(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    terms: dict = {}
    for record in records:
        plain = _plain(record)
        for k, m in enumerate(plain):
            if m["role"] != "assistant":
                continue
            tools = _tools_seen(record, k)
            prompt = tok.apply_chat_template(plain[:k], tools=tools, tokenize=False, add_generation_prompt=True)
            full = tok.apply_chat_template(plain[:k + 1], tools=tools, tokenize=False)
            ids = encode(prompt) + encode(full[len(prompt):])
            for p in range(len(encode(prompt)), len(ids)):
                key = (tuple(ids[:p]), ids[p])
                terms[key] = terms.get(key, 0.0) + 1.0
    return terms


def test_one_pass_rows_sharing_prefixes_train_exactly_the_views_with_their_tools(qwen3_tokenizer):
    """One tree per conversation, trees of several conversations merged where they share a prefix (the default with
    packing): a view rendered with other tools has another prefix, so it is a branch of its own, never merged with
    a view of the old list; the rows' loss terms are those of the template's own N-pass views."""
    from onepass.layout.share import loss_terms_reference, same_terms

    records = [miss_func_record(topic) for topic in ("report", "notes", "budget")]
    convs = [parse_record(r, source="miss_func.jsonl", index=i, unit="line") for i, r in enumerate(records)]
    rows, stats = prepare(convs, qwen3_tokenizer, PrepareConfig(pack=True, max_tokens=32768))
    assert stats.views_trained == 18 and not stats.skipped and stats.shared["trees_shared"] == 3
    terms = loss_terms_reference(rows)
    assert same_terms({(k[0], k[1]): v for k, v in terms.items()}, _reference_terms(qwen3_tokenizer, records))


def test_a_sharegpt_turn_carries_its_tools_too_and_the_record_round_trips(qwen3_tokenizer):
    from onepass.data.sources import to_record

    record = miss_func_record()
    conv = parse_record(record, source="miss_func.jsonl", index=1, unit="line")
    assert conv.tools_at(7) == tuple(record["tools"]) and conv.tools_at(9) == (LS, CD, SORT)
    assert parse_record(to_record(conv)) == dataclasses.replace(conv, source="<memory> record 0")
    sharegpt = {"tools": json.dumps([LS, CD]), "conversations": [
        {"from": "human", "value": "List the files."}, {"from": "gpt", "value": "Done."},
        {"from": "human", "value": UPDATED, "tools": json.dumps([LS, CD, SORT])}, {"from": "gpt", "value": "Ok."}]}
    read = parse_record(sharegpt)
    assert read.tools_at(1) == (LS, CD) and read.tools_at(3) == (LS, CD, SORT)
    views = render_conversation(read, qwen3_tokenizer).views
    assert ["sort" in qwen3_tokenizer.decode(v.tokens) for v in views] == [False, True]


@pytest.mark.parametrize(("messages", "why"), [
    ([{"role": "system", "content": "S", "tools": [LS]}, {"role": "user", "content": "q"},
      {"role": "assistant", "content": "a"}], "message 0: 'tools' on the system message: give the first tool list"),
    ([{"role": "user", "content": "q", "tools": {"name": "ls"}}, {"role": "assistant", "content": "a"}],
     "message 0: a message's 'tools' must be a list of objects"),
    ([{"role": "user", "content": "q", "tools": "[oops"}, {"role": "assistant", "content": "a"}],
     "message 0: a message's 'tools' is a string that is not valid JSON"),
])
def test_a_tool_list_that_cannot_be_read_is_one_line_naming_the_message(messages, why):
    with pytest.raises(ConversationError) as e:
        parse_record({"messages": messages}, source="d.jsonl", index=1, unit="line")
    assert str(e.value).startswith(f"d.jsonl line 1, {why}"), str(e.value)
