"""Conversations: the frozen record every later stage reads, parsed and validated from any shape.

Why this module exists: training data arrives in several shapes (OpenAI/TRL
``messages``, ShareGPT ``conversations``, the paper's re-upload
``interactions``) and with reasoning in several places (``reasoning_content``,
``reasoning``, ``thinking``, or inline ``<think>...</think>``). Everything after
this module sees one shape, :class:`Conversation`, and every defect in the
input is reported here with the file, record and message it came from.

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

No torch here: this is pure data.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onepass.errors import ConversationError
from onepass.records import iter_records

ROLES = ("system", "developer", "user", "assistant", "tool")  # developer: as system, role kept
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
_BAD_TEXT = re.compile("[\x00\ud800-\udfff]")  # NUL or a lone surrogate (a pair is one code point in str)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "model": "assistant", "system": "system", "tool": "tool", "function": "tool", "observation": "tool"}


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolCall:
    """One function call made by the assistant. ``arguments`` is always a dict."""

    name: str
    arguments: dict[str, Any]
    id: str | None = None

    def to_template(self, *, arguments_json: bool = False) -> dict[str, Any]:
        """The HF tool-call dict; ``arguments_json`` gives ``arguments`` as a JSON string, as the
        DeepSeek-V3 and Kimi-K2 templates expect (:mod:`onepass.template_probe` finds out which)."""
        args: Any = json.dumps(self.arguments, ensure_ascii=False) if arguments_json else self.arguments
        call: dict[str, Any] = {
            "type": "function",
            "function": {"name": self.name, "arguments": args},
        }
        if self.id is not None:
            call["id"] = self.id
        return call


@dataclass(frozen=True, kw_only=True, slots=True)
class Message:
    """One message. Assistant messages carry ``reasoning`` (None = absent, "" = empty)."""

    role: str
    content: str
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    name: str | None = None
    tool_call_id: str | None = None

    def to_template(self, *, arguments_json: bool = False,
                    reasoning_key: str = "reasoning_content") -> dict[str, Any]:
        """The dict a HF chat template expects (reasoning under ``reasoning_key``: ``reasoning_content``
        as Qwen3/DeepSeek name it, ``thinking`` for gpt-oss)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.role == "assistant":
            if self.reasoning is not None:
                out[reasoning_key] = self.reasoning
            if self.tool_calls:
                out["tool_calls"] = [t.to_template(arguments_json=arguments_json) for t in self.tool_calls]
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


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

    def at(self, k: int) -> str:
        """``SOURCE, message N``: message ``k`` numbered as in the record, as parse errors name it."""
        return message_at(self.source, k + self.first_message)

    @property
    def num_assistant_turns(self) -> int:
        return sum(m.role == "assistant" for m in self.messages)

    def template_messages(self, upto: int | None = None, *, arguments_json: bool = False,
                          reasoning_key: str = "reasoning_content", developer: bool = True,
                          tool_ids: str = "given") -> list[dict[str, Any]]:
        """Messages as template dicts, system first, ``messages[:upto]`` (fields as in
        :meth:`Message.to_template`; ``developer=False`` hands a developer prompt over as system;
        ``tool_ids="functions"`` renames tool-call ids as :func:`functions_ids` does)."""
        role = self.system_role if developer else "system"
        head = [{"role": role, "content": self.system}] if self.system is not None else []
        out = [m.to_template(arguments_json=arguments_json, reasoning_key=reasoning_key)
               for m in self.messages[:upto]]
        if tool_ids == "functions":
            calls, results = functions_ids(self.messages)
            for i, m in enumerate(out):
                for j, call in enumerate(m.get("tool_calls", ())):
                    call["id"] = calls[i, j]
                if i in results:
                    m["tool_call_id"] = results[i]
        return head + out

    def template_tools(self) -> list[dict[str, Any]] | None:
        return list(self.tools) if self.tools else None


def functions_ids(messages: tuple[Message, ...]) -> tuple[dict[tuple[int, int], str], dict[int, str]]:
    """Tool-call ids ``functions.NAME:IDX`` (IDX counts every call of the conversation, as vLLM's
    Kimi-K2 parser does): the Kimi-K2 templates render a call by its id only, so an OpenAI id
    ``call_0`` would hide the tool's name. Returns ``{(message, call): id}`` and ``{tool message: id}``;
    a result gets its call's new id by the old id, else the next unanswered call of the turn before.

    >>> functions_ids((Message(role="assistant", content="", tool_calls=(ToolCall(name="f", arguments={}),)),
    ...                Message(role="tool", content="1")))
    ({(0, 0): 'functions.f:0'}, {1: 'functions.f:0'})
    """
    calls: dict[tuple[int, int], str] = {}
    results: dict[int, str] = {}
    by_old: dict[str, str] = {}
    pending: list[str] = []
    for i, m in enumerate(messages):
        if m.role == "assistant" and m.tool_calls:
            pending = []
            for j, call in enumerate(m.tool_calls):
                calls[i, j] = f"functions.{call.name}:{len(calls)}"
                pending.append(calls[i, j])
                if call.id is not None:
                    by_old[call.id] = calls[i, j]
        elif m.role == "tool":
            new = by_old.get(m.tool_call_id or "") or (pending[0] if m.tool_call_id is None and pending else None)
            if new is not None:
                results[i], pending = new, [p for p in pending if p != new]
    return calls, results


def message_at(source: str, number: int) -> str:
    """``SOURCE, message N``: the one wording of every error and skip naming a record's message N."""
    return f"{source}, message {number}"


@dataclass(frozen=True, kw_only=True, slots=True)
class _Where:
    source: str
    index: int
    unit: str = "record"

    def __call__(self, msg: str, message: int | None = None) -> ConversationError:
        at = f"{self.source} {self.unit} {self.index}"
        return ConversationError(f"{at if message is None else message_at(at, message)}: {msg}")


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


def _text(value: Any, what: str, where: _Where, i: int, *, allow_none: bool = False) -> str:
    if value is None and allow_none:
        return ""
    if not isinstance(value, str):
        raise where(f"{what} must be a string, got {type(value).__name__}", i)
    return value


def bad_text(value: Any, path: str = "") -> str | None:
    """Where in ``value`` (nested dicts/lists) a string holds a NUL or a lone surrogate, or None.

    >>> print(bad_text({"messages": [{"content": "ok"}, {"content": "a\\ud800b"}]}))
    messages[1].content: a lone surrogate U+D800 at character 1 (not encodable as UTF-8)
    >>> bad_text({"content": "fine"}) is None
    True
    """
    if isinstance(value, str):
        found = _BAD_TEXT.search(value)
        if found is None:
            return None
        ch = found.group()
        what = "a NUL character" if ch == "\x00" else f"a lone surrogate U+{ord(ch):04X}"
        return (f"{path or 'text'}: {what} at character {found.start()}"
                + ("" if ch == "\x00" else " (not encodable as UTF-8)"))
    if isinstance(value, Mapping):
        for k, v in value.items():
            key = str(k)
            if _BAD_TEXT.search(key):
                return f"{path or 'record'}: a key holds a NUL or a lone surrogate"
            found = bad_text(v, f"{path}.{key}" if path else key)
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for j, v in enumerate(value):
            found = bad_text(v, f"{path}[{j}]")
            if found:
                return found
    return None


def _check_text(record: Mapping[str, Any], where: _Where) -> None:
    """Refuse a record with a string no tokenizer can encode, naming the message it is in."""
    found = bad_text(record)
    if found is None:
        return
    m = re.match(r"(messages|conversations|interactions)\[(\d+)\]", found)
    raise where(f"{found}", int(m.group(2)) if m else None)


def _reasoning_field(raw: Mapping[str, Any], where: _Where, i: int) -> str | None:
    """The reasoning of an assistant message; several fields must agree (none is dropped silently)."""
    given = {key: _text(raw[key], key, where, i) for key in REASONING_KEYS if raw.get(key) is not None}
    if len(set(given.values())) > 1:
        raise where("conflicting reasoning fields " + ", ".join(given)
                    + " hold different text: keep one (onepass will not guess which)", i)
    return next(iter(given.values()), None)


def _tool_calls(raw: Any, where: _Where, i: int) -> tuple[ToolCall, ...]:
    if raw in (None, []):
        return ()
    if not isinstance(raw, list):
        raise where(f"tool_calls must be a list, got {type(raw).__name__}", i)
    calls = []
    for j, call in enumerate(raw):
        if not isinstance(call, Mapping):
            raise where(f"tool_calls[{j}] must be an object", i)
        fn = call.get("function", call)
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(name, str) or not name:
            raise where(f"tool_calls[{j}] has no function name", i)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise where(f"tool_calls[{j}].function.arguments is not valid JSON ({e})", i) from None
        if not isinstance(args, Mapping):
            raise where(f"tool_calls[{j}].function.arguments must be an object or a JSON string", i)
        call_id = call.get("id")
        calls.append(ToolCall(name=name, arguments=dict(args), id=call_id if isinstance(call_id, str) else None))
    return tuple(calls)


def _message(raw: Any, where: _Where, i: int) -> Message:
    if not isinstance(raw, Mapping):
        raise where(f"a message must be an object, got {type(raw).__name__}", i)
    role = raw.get("role")
    if role not in ROLES:
        raise where(f"unknown role {role!r}; expected one of {', '.join(ROLES)}", i)
    calls = _tool_calls(raw.get("tool_calls"), where, i) if role == "assistant" else ()
    content = _text(raw.get("content"), "content", where, i, allow_none=role == "assistant" and bool(calls))
    reasoning = None
    if role == "assistant":
        reasoning = _reasoning_field(raw, where, i)
        if "<think>" in content and "</think>" not in content:
            raise where("unclosed <think> in the content (a cut-off generation?)", i)
        inline, rest = split_inline_reasoning(content)
        if inline is not None:
            if reasoning is not None and inline.strip():
                raise where("reasoning given both as a field and inline in <think>...</think>", i)
            reasoning = inline if reasoning is None else reasoning
            content = rest
    name = raw.get("name") if isinstance(raw.get("name"), str) else None
    call_id = raw.get("tool_call_id") if isinstance(raw.get("tool_call_id"), str) else None
    return Message(role=role, content=content, reasoning=reasoning, tool_calls=calls,
                   name=name, tool_call_id=call_id)


def validate(messages: tuple[Message, ...], where: _Where, *, offset: int = 0) -> None:
    """Role order: starts with a user turn; tool results follow a call; has an assistant turn.

    ``offset`` is added to message numbers in errors (1 when a leading system
    message was taken out), so they match the record's own list.
    """
    if not messages:
        raise where("the conversation is empty")
    for i, m in enumerate(messages):
        if m.role in ("system", "developer"):
            raise where(f"a {m.role} message is only allowed first", i + offset)
    if messages[0].role != "user":
        raise where(f"the first message must be from the user, got {messages[0].role!r}", offset)
    for i, m in enumerate(messages):
        prev = messages[i - 1] if i else None
        i += offset
        if m.role == "tool" and not (prev is not None and (prev.role == "tool" or prev.tool_calls)):
            raise where("tool message without a preceding assistant tool call", i)
        if m.role == "assistant" and prev is not None and prev.role == "assistant" and not prev.tool_calls:
            raise where("two assistant messages in a row (roles out of order)", i)
    if not any(m.role == "assistant" for m in messages):
        raise where("no assistant turn: nothing to train")


def _from_messages(raw: list[Any], where: _Where) -> tuple[str | None, str, list[Message]]:
    msgs = [_message(m, where, i) for i, m in enumerate(raw)]
    if msgs and msgs[0].role in ("system", "developer"):
        return msgs[0].content, msgs[0].role, msgs[1:]
    return None, "system", msgs


def _sharegpt(raw: list[Any], where: _Where) -> list[dict[str, Any]]:
    out = []
    for i, turn in enumerate(raw):
        if not isinstance(turn, Mapping):
            raise where(f"a turn must be an object, got {type(turn).__name__}", i)
        who = turn.get("from", turn.get("role"))
        if who not in SHAREGPT_ROLES:
            raise where(f"unknown speaker {who!r}; expected one of {', '.join(SHAREGPT_ROLES)}", i)
        msg = {"role": SHAREGPT_ROLES[who], "content": turn.get("value", turn.get("content"))}
        for key in REASONING_KEYS:
            if key in turn:
                msg[key] = turn[key]
        out.append(msg)
    return out


def _interactions(raw: list[Any], where: _Where) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, turn in enumerate(raw):
        if not isinstance(turn, Mapping) or "query" not in turn or "answer" not in turn:
            raise where("an interaction must be an object with 'query', 'answer' (and 'think')", i)
        out.append({"role": "user", "content": turn["query"]})
        out.append({"role": "assistant", "content": turn["answer"], "reasoning": turn.get("think")})
    return out


def parse_record(record: Any, *, source: str = "<memory>", index: int = 0,
                 unit: str = "record") -> Conversation:
    """One raw record (any supported shape) -> a validated :class:`Conversation`.

    ``unit`` says what ``index`` counts in error messages ("record" or "line").
    """
    where = _Where(source=source, index=index, unit=unit)
    if not isinstance(record, Mapping):
        raise where(f"a record must be a JSON object, got {type(record).__name__}")
    _check_text(record, where)
    system = record.get("system") if isinstance(record.get("system"), str) else None
    if "messages" in record:
        raw = record["messages"]
    elif "conversations" in record:
        raw = record["conversations"]
        if isinstance(raw, list):
            raw = _sharegpt(raw, where)
    elif "interactions" in record:
        raw = record["interactions"]
        if isinstance(raw, list):
            raw = _interactions(raw, where)
    else:
        raise where("no 'messages', 'conversations' or 'interactions' field; keys are "
                    + ", ".join(sorted(map(str, record))))
    if not isinstance(raw, list):
        raise where(f"the messages must be a list, got {type(raw).__name__}")
    inline_system, system_role, msgs = _from_messages(raw, where)
    offset = 1 if inline_system is not None else 0
    if inline_system is not None:
        if system is not None:
            raise where("system prompt given both as a field and as the first message")
        system = inline_system
    messages = tuple(msgs)
    validate(messages, where, offset=offset)
    tools = record.get("tools") or ()
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise where(f"'tools' is a string that is not valid JSON ({e})") from None
    if not isinstance(tools, (list, tuple)) or not all(isinstance(t, Mapping) for t in tools):
        raise where("'tools' must be a list of objects")
    rid = record.get("id")
    if system is not None and not system.strip():
        system = None  # an empty system field (common in parquet columns) means none
    return Conversation(messages=messages, system=system, system_role=system_role,
                        tools=tuple(dict(t) for t in tools), source=f"{source} {unit} {index}",
                        id=str(rid) if rid is not None else None, first_message=offset)


@dataclass(kw_only=True, slots=True)
class ReadReport:
    """What a lenient read kept and what it skipped (with reasons)."""

    conversations: list[Conversation] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


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
        try:
            if isinstance(raw, ConversationError):
                raise raw
            report.conversations.append(parse_record(raw, source=str(path), index=index, unit=unit))
        except ConversationError as e:
            if strict:
                raise
            report.skipped.append(str(e))
        if limit is not None and len(report.conversations) >= limit:
            break
    return report
