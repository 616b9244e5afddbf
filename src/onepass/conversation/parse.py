"""Conversations: the frozen record every later stage reads, parsed and validated from any shape.

Why this module exists: training data arrives in several shapes (OpenAI/TRL
``messages``, ShareGPT ``conversations`` with LLaMA-Factory's ``function_call`` /
``observation`` speakers, Hermes inline ``<tool_call>`` JSON, Llama-Nemotron
``input``/``output``, the paper's re-upload ``interactions``) and with reasoning in
several places (``reasoning_content``, ``reasoning``, ``thinking``, or a leading
``<think>...</think>`` block). Everything after this module sees one shape,
:class:`Conversation`, as the template would see the record: every message and
field it can render kept (an empty system message, a tool call's arguments string,
OpenAI ``weight`` 0 as a turn not to train), every conversion named
(:data:`onepass.conversation.schemas.CONVERSIONS`, counted in stats), and every defect in the input reported
here with the file, record and message it came from (docs/data.md, "Record schemas").

Worked example::

    >>> rec = {"messages": [{"role": "user", "content": "2+2?"},
    ...                     {"role": "assistant", "content": "<think>2+2=4</think>4"}]}
    >>> c = parse_record(rec, source="x.jsonl", index=0)
    >>> c.messages[1].reasoning, c.messages[1].content
    ('2+2=4', '4')

Text that no tokenizer can take is refused here, where file and message are
known: a lone surrogate (``"\\ud800"`` in JSON), a NUL character, or a
.jsonl line that is not UTF-8. A lenient reader counts each as a skip naming
the line; ``--strict`` stops at it. Two reasoning fields that disagree
(``reasoning_content`` and ``thinking`` both set, different) are an error
naming the record: keeping one and dropping the other would be a silent loss.

How a conversation is handed to a chat template (message dicts, the fields each template
expects) is :mod:`onepass.render.messages`. No torch here: this is pure data.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onepass.errors import ConversationError, message_at
from onepass.conversation.schemas import (
    FIELD_AND_INLINE,
    HERMES_CALL,
    MESSAGE_KEYS,
    TRAILING,
    Where,
    check_text,
    finite_numbers,
    input_output,
    interactions,
    leading_reasoning,
    loads_json,
    message_content,
    reasoning_field,
    record_fields,
    sharegpt,
    system_field,
    trains,
    unknown_fields,
    unknown_schema,
)
from onepass.conversation.records import iter_records
from onepass.conversation.tau2 import is_tau2, tau2_messages

ROLES = ("system", "developer", "user", "assistant", "tool")  # developer: as system, role kept
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolCall:
    """One function call made by the assistant. ``arguments`` is always a dict (parsed, checked);
    ``text`` is the JSON string the record gave them as (None when it gave an object), kept byte for
    byte: ``{"city":"\\u5317\\u4eac","days":1e1}`` is what the model emitted, not ``{"city": "北京", ...}``."""

    name: str
    arguments: dict[str, Any]
    id: str | None = None
    text: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Message:
    """One message. Assistant messages carry ``reasoning`` (None = absent, "" = empty)."""

    role: str
    content: str
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    name: str | None = None
    tool_call_id: str | None = None
    train: bool = True  # False: in the context of later turns, never trained (OpenAI fine-tuning "weight": 0)
    tools: tuple[dict[str, Any], ...] | None = None  # the tool list from this message on (BFCL miss_func: a tool
    # added after some turns); None: the one before it (Conversation.tools_at)
    marked: bool = False  # the record marks it "weight": 1 (trained under --train-turns weight: onepass.conversation.turns)
    text: str | None = field(default=None, compare=False)  # the content as the record gave it, when its leading
    # <think> block was read as reasoning: what a template that reads no reasoning field renders (inline_reasoning);
    # the same message either way (reasoning and content are equal), so it is not compared


@dataclass(frozen=True, kw_only=True, slots=True)
class Conversation:
    """A validated multi-turn conversation.

    ``messages`` never holds the system prompt: it is in ``system``. ``source``
    names where the record came from (``file.jsonl record 12``) for errors.
    """

    messages: tuple[Message, ...]
    system: str | None = None
    system_role: str = "system"  # or "developer", as the record gave it (gpt-oss's templates read both)
    tools: tuple[dict[str, Any], ...] = ()
    source: str = "<memory>"
    id: str | None = None
    first_message: int = 0  # the record's own number of messages[0]: 1 after a system message in the list
    conversions: tuple[str, ...] = ()  # what was converted to read the record (schemas.CONVERSIONS), counted
    tool_changes: tuple[int, ...] = ()  # the messages that carry a tool list of their own (Message.tools), in order

    def at(self, k: int) -> str:
        """``SOURCE, message N``: message ``k`` numbered as in the record, as parse errors name it."""
        return message_at(self.source, k + self.first_message)

    def tools_at(self, k: int) -> tuple[dict[str, Any], ...]:
        """The tools message ``k`` was written with (the view of assistant turn ``k`` is rendered with them): the
        list the last message up to ``k`` carries, else the record's ``tools``.

        >>> c = Conversation(messages=(Message(role="user", content="q"), Message(role="assistant", content="a"),
        ...     Message(role="user", content="more", tools=({"name": "f"},)), Message(role="assistant", content="b")),
        ...     tool_changes=(2,))
        >>> c.tools_at(1), c.tools_at(3)
        ((), ({'name': 'f'},))
        """
        at = bisect.bisect_right(self.tool_changes, k)
        return self.tools if at == 0 else self.messages[self.tool_changes[at - 1]].tools  # type: ignore[return-value]

    def at_turn(self, k: int) -> Conversation:
        """This conversation as the template sees it at message ``k``: its ``tools`` are :meth:`tools_at` ``(k)``
        (itself when no message carries a tool list)."""
        if not self.tool_changes:
            return self
        return dataclasses.replace(self, tools=self.tools_at(k), tool_changes=())

    @property
    def greeting(self) -> int | None:
        """The assistant message that opens the conversation (0), or None: it answers no user turn (tau2-bench's
        agent greets first, ``"Hi! How can I help you today?"``, a text no model wrote), so it is in the
        context of every later view but trained only when asked (``--train-greeting``; counted either way)."""
        return 0 if self.messages and self.messages[0].role == "assistant" else None

    @property
    def num_assistant_turns(self) -> int:
        return sum(m.role == "assistant" for m in self.messages)

    @property
    def trailing_messages(self) -> int:
        """Messages after the last assistant turn: no view holds them (a view ends with its assistant turn), so
        they are never trained nor seen in training; such records are counted (``schemas.TRAILING``)."""
        last = max((i for i, m in enumerate(self.messages) if m.role == "assistant"), default=-1)
        return len(self.messages) - 1 - last


def split_inline_reasoning(content: str) -> tuple[str | None, str]:
    """Split ``<think>r</think>c`` into (r, c); (None, content) when there is no ``</think>``.

    Mirrors the Qwen3 template's own parsing: reasoning is what lies between the
    last ``<think>`` before ``</think>`` and it, newlines trimmed at its ends.
    """
    if "</think>" not in content:
        return None, content
    head, _, tail = content.partition("</think>")
    reasoning = head.split("<think>")[-1].strip("\n")
    return reasoning, tail.lstrip("\n")


def _string(raw: Mapping[str, Any], key: str, what: str, where: Where, i: int) -> str | None:
    """An optional string field (a name, an id): absent or null is None; anything else is an error (a number
    dropped here would be a name or id the template never renders)."""
    value = raw.get(key)
    if value is not None and not isinstance(value, str):
        raise where(f"{what} must be a string, got {type(value).__name__} {value!r:.40}", i)
    return value


def _tool_calls(raw: Any, where: Where, i: int) -> tuple[ToolCall, ...]:
    if raw in (None, []):
        return ()
    if not isinstance(raw, list):
        raise where(f"tool_calls must be a list, got {type(raw).__name__}", i)
    calls = []
    for j, call in enumerate(raw):
        if not isinstance(call, Mapping):
            raise where(f"tool_calls[{j}] must be an object", i)
        if call.get("type", "function") != "function":
            raise where(f"tool_calls[{j}] is of type {call.get('type')!r}; onepass reads function calls "
                        "(chat templates render those)", i)
        fn = call.get("function", call)
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(name, str) or not name:
            raise where(f"tool_calls[{j}] has no function name", i)
        args = fn.get("arguments", {})
        text = args if isinstance(args, str) and args.strip() else None
        if isinstance(args, str):
            args = loads_json(args, f"tool_calls[{j}].function.arguments", where, i) if args.strip() else {}
        if not isinstance(args, Mapping):
            raise where(f"tool_calls[{j}].function.arguments must be an object or a JSON string", i)
        if (bad := finite_numbers(args)) is not None:
            raise where(f"tool_calls[{j}].function.arguments holds {bad}, not a JSON number (a template would "
                        "print it as NaN or Infinity)", i)
        calls.append(ToolCall(name=name, arguments=dict(args), id=_string(call, "id", f"tool_calls[{j}].id", where, i),
                              text=text))
    return tuple(calls)


def _message(raw: Any, where: Where, i: int) -> Message:
    if not isinstance(raw, Mapping):
        raise where(f"a message must be an object, got {type(raw).__name__}", i)
    role = raw.get("role")
    if role not in ROLES:
        raise where(f"unknown role {role!r}; expected one of {', '.join(ROLES)}", i)
    unknown_fields(raw, MESSAGE_KEYS, where, i)
    if role != "assistant" and raw.get("tool_calls") not in (None, []):
        raise where(f"tool_calls on a {role} message: chat templates render an assistant's calls only, so they "
                    "would be dropped; give them to the assistant message that made them", i)
    calls = _tool_calls(raw.get("tool_calls"), where, i) if role == "assistant" else ()
    content = message_content(raw, role, calls, where, i)
    reasoning = text = None
    if role == "assistant":
        reasoning = reasoning_field(raw, where, i)
        inline, rest = leading_reasoning(content)
        if inline is None and content.lstrip().startswith("<think>"):
            raise where("unclosed <think> at the start of the content (a cut-off generation?)", i)
        if inline is not None:
            if reasoning is None or inline.strip() == reasoning.strip() or not inline.strip():
                reasoning = inline if reasoning is None else reasoning  # the same reasoning, or an empty block
                content, text = rest, content
            else:  # the field is the reasoning; the text is the record's, kept as it is
                where.converted(FIELD_AND_INLINE)
    name = _string(raw, "name", "name", where, i)
    call_id = _string(raw, "tool_call_id", "tool_call_id", where, i)
    tools = raw.get("tools")
    train = trains(raw, role, where, i)  # checks the weight: 0 or 1, 1 on an assistant message only
    return Message(role=role, content=content, reasoning=reasoning, tool_calls=calls, name=name,
                   tool_call_id=call_id, train=train, marked=role == "assistant" and raw.get("weight") == 1, text=text,
                   tools=None if tools in (None, [], "") else tool_list(tools, "a message's 'tools'", where, i))


def tool_list(value: Any, what: str, where: Where, i: int | None = None) -> tuple[dict[str, Any], ...]:
    """A tool list (the record's ``tools``, or a message's: the list from that message on): a list of objects,
    or a JSON string of one (ShareGPT datasets write it so); numbers JSON can hold."""
    if isinstance(value, str):
        value = loads_json(value, f"{what} is a string that", where, i)
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, Mapping) for t in value):
        raise where(f"{what} must be a list of objects", i)
    if (bad := finite_numbers(value)) is not None:
        raise where(f"{what} holds {bad}, not a JSON number (a template would print it as NaN or Infinity)", i)
    return tuple(dict(t) for t in value)


def _hermes_calls(m: Message, where: Where, i: int) -> Message:
    """An assistant message followed by a tool message, its calls written inline as Hermes does
    (``text<tool_call>{"name": ..., "arguments": ...}</tool_call>``): the calls as tool_calls, the text
    before them as content. Refused when a block is not such JSON or text follows the blocks."""
    blocks = list(_HERMES_BLOCK.finditer(m.content))
    if not blocks:
        return m
    if m.content[blocks[-1].end():].strip() or any(m.content[a.end():b.start()].strip()
                                                   for a, b in zip(blocks, blocks[1:])):
        raise where("inline <tool_call> blocks with text between or after them before a tool message: "
                    "onepass reads Hermes calls at the end of the content, or OpenAI tool_calls", i)
    calls = []
    for j, block in enumerate(blocks):
        call = loads_json(block.group(1), f"inline <tool_call> block {j}", where, i,
                          hint='Hermes writes {"name": ..., "arguments": {...}}')
        if not isinstance(call, Mapping):
            raise where(f"inline <tool_call> block {j} is not a JSON object", i)
        calls.append(call)
    where.converted(HERMES_CALL)
    return dataclasses.replace(m, content=m.content[:blocks[0].start()].rstrip(),
                               tool_calls=_tool_calls(calls, where, i))


def validate(messages: tuple[Message, ...], where: Where, *, offset: int = 0) -> None:
    """Role order: tool results follow a call; no two answers in a row; has an assistant turn.

    The first message is a user's, or an assistant's that opens the conversation (a greeting:
    :attr:`Conversation.greeting`; tau2-bench's agent speaks first): valid where the template renders it,
    a counted skip (the template's own error, naming the message) where it raises. ``offset`` is added to
    message numbers in errors (1 when a leading system message was taken out), so they match the record's
    own list.
    """
    if not messages:
        raise where("the conversation is empty")
    for i, m in enumerate(messages):
        if m.role in ("system", "developer"):
            raise where(f"a {m.role} message is only allowed first", i + offset)
    for i, m in enumerate(messages):
        prev = messages[i - 1] if i else None
        i += offset
        if m.role == "tool" and not (prev is not None and (prev.role == "tool" or prev.tool_calls)):
            raise where("tool message without a preceding assistant tool call", i)
        if m.role == "assistant" and prev is not None and prev.role == "assistant" and not prev.tool_calls:
            raise where("two assistant messages in a row (roles out of order)", i)
    if not any(m.role == "assistant" for m in messages):
        raise where("no assistant turn: nothing to train")


def _from_messages(raw: list[Any], where: Where) -> tuple[str | None, str, list[Message]]:
    msgs = [_message(m, where, i) for i, m in enumerate(raw)]
    for i, m in enumerate(msgs[:-1]):
        if m.role == "assistant" and not m.tool_calls and msgs[i + 1].role == "tool":
            msgs[i] = _hermes_calls(m, where, i)
    if msgs and msgs[0].role in ("system", "developer"):
        if msgs[0].tools is not None:
            raise where(f"'tools' on the {msgs[0].role} message: give the first tool list as the record's 'tools' "
                        "(a message's 'tools' is the list from that message on)", 0)
        return msgs[0].content, msgs[0].role, msgs[1:]
    return None, "system", msgs


def parse_record(record: Any, *, source: str = "<memory>", index: int = 0,
                 unit: str = "record") -> Conversation:
    """One raw record (any supported shape) -> a validated :class:`Conversation`.

    ``unit`` says what ``index`` counts in error messages ("record" or "line").
    """
    where = Where(source=source, index=index, unit=unit)
    if not isinstance(record, Mapping):
        raise where(f"a record must be a JSON object, got {type(record).__name__}")
    check_text(record, where)
    record_fields(record, where)
    system, field_role = system_field(record, where)  # a blank field (a parquet column) is none; a message is kept
    if "messages" in record:
        raw = record["messages"]
        if is_tau2(raw):  # a tau2-bench simulation's messages, as it saved them
            raw = tau2_messages(raw, where)
    elif "conversations" in record:
        raw = record["conversations"]
        if isinstance(raw, list):
            raw = sharegpt(raw, where)
    elif "interactions" in record:
        raw = record["interactions"]
        if isinstance(raw, list):
            raw = interactions(raw, where)
    elif "input" in record and "output" in record and "instruction" not in record:  # Alpaca: refused
        raw = input_output(record, where)
    else:
        raise unknown_schema(record, where)
    if not isinstance(raw, list):
        raise where(f"the messages must be a list, got {type(raw).__name__}")
    inline_system, system_role, msgs = _from_messages(raw, where)
    offset = 1 if inline_system is not None else 0
    if inline_system is not None:
        if system is not None:
            raise where("system prompt given both as a field and as the first message")
        system = inline_system
    elif system is not None:
        system_role = field_role
    messages = tuple(msgs)
    validate(messages, where, offset=offset)
    if messages[-1].role != "assistant":
        where.converted(TRAILING)  # a user's last word (149 of 200 tau-bench records): in no view, counted
    tools = tool_list(record.get("tools") or (), "'tools'", where)
    rid = record.get("id")
    return Conversation(messages=messages, system=system, system_role=system_role,
                        tools=tools, source=f"{source} {unit} {index}",
                        id=str(rid) if rid is not None else None, first_message=offset,
                        conversions=tuple(where.conversions),
                        tool_changes=tuple(k for k, m in enumerate(messages) if m.tools is not None))


@dataclass(kw_only=True, slots=True)
class ReadReport:
    """What a lenient read kept and what it skipped (with reasons)."""

    conversations: list[Conversation] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    more: bool = False  # the read stopped at its limit with records left (a command says the limit cut it)


def read_conversations(path: str | Path, *, strict: bool = True, limit: int | None = None) -> ReadReport:
    """Read and validate every record of ``path``.

    ``strict`` raises on the first bad record; otherwise bad records are counted
    in ``ReadReport.skipped`` with their error (never silently dropped).
    A .jsonl record is numbered by its line, other formats by their index.
    """
    report = ReadReport()
    unit = "line" if Path(path).suffix.lower() in (".jsonl", ".ndjson") else "record"
    if limit is not None and limit <= 0:
        return report
    for index, raw in iter_records(path):
        full = limit is not None and len(report.conversations) >= limit  # reading on only to say ``more``
        try:
            if isinstance(raw, ConversationError):
                raise raw
            conv = parse_record(raw, source=str(path), index=index, unit=unit)
        except ConversationError as e:
            if strict and not full:
                raise
            if not full:
                report.skipped.append(str(e))
            continue
        if full:
            report.more = True
            break
        report.conversations.append(conv)
    return report
