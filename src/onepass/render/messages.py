"""What a chat template sees of a conversation: the message dicts handed to ``apply_chat_template``.

Why this module exists: a :class:`onepass.conversation.parse.Conversation` is the record as read,
one shape for every input; templates differ in how they want that shape handed over. Some
concatenate tool-call ``arguments`` as a string (DeepSeek-V3), some render a record's JSON
string byte for byte (Qwen3), Kimi-K2 renders a call by its id only, gpt-oss reads reasoning
under ``thinking`` and renders a ``developer`` prompt. :mod:`onepass.render.fields` probes which
of these a template wants (:attr:`~onepass.render.fields.TemplateFields.message_options`); this
module turns a conversation into those dicts, and the table of template quirks
(:mod:`onepass.render.quirks`) names the function each quirk is handled in. With no options the
dicts are OpenAI's (reasoning as ``reasoning_content``), which is also how
:func:`onepass.data.sources.to_record` writes a conversation back as a record.

Worked example::

    >>> from onepass.conversation.parse import parse_record
    >>> c = parse_record({"system": "Be brief.", "messages": [
    ...     {"role": "user", "content": "2+2?"},
    ...     {"role": "assistant", "content": "4", "reasoning_content": "2+2=4"}]})
    >>> template_messages(c)
    [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': '2+2?'}, \
{'role': 'assistant', 'content': '4', 'reasoning_content': '2+2=4'}]
    >>> template_messages(c, 1, reasoning_key="thinking")[-1]
    {'role': 'user', 'content': '2+2?'}

No torch here: this is pure data.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from onepass.conversation.parse import Conversation, Message, ToolCall


def tool_call_dict(call: ToolCall, *, arguments_json: bool = False, verbatim: bool = False) -> dict[str, Any]:
    """The HF tool-call dict; ``arguments_json`` gives ``arguments`` as a JSON string, as the
    DeepSeek-V3 and Kimi-K2 templates expect; ``verbatim`` gives a record's own string unchanged
    (for a template that renders a string as it is: :mod:`onepass.render.fields` finds out which)."""
    args: Any = json.dumps(call.arguments, ensure_ascii=False) if arguments_json else call.arguments
    if call.text is not None and (verbatim or arguments_json):
        args = call.text
    out: dict[str, Any] = {
        "type": "function",
        "function": {"name": call.name, "arguments": args},
    }
    if call.id is not None:
        out["id"] = call.id
    return out


def message_dict(m: Message, *, arguments_json: bool = False, verbatim: bool = False,
                 reasoning_key: str = "reasoning_content", inline_reasoning: bool = False) -> dict[str, Any]:
    """The dict a HF chat template expects (reasoning under ``reasoning_key``: ``reasoning_content``
    as Qwen3/DeepSeek name it, ``thinking`` for gpt-oss). ``inline_reasoning``: for a template that reads no
    reasoning field (SmolLM3), a content the record gave as ``<think>r</think>a`` goes over as it was given,
    the text that template renders for the record, instead of ``a`` with ``r`` under a key it never reads."""
    if inline_reasoning and m.text is not None:
        m = dataclasses.replace(m, content=m.text, reasoning=None)
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.role == "assistant":
        if m.reasoning is not None:
            out[reasoning_key] = m.reasoning
        if m.tool_calls:
            out["tool_calls"] = [tool_call_dict(t, arguments_json=arguments_json, verbatim=verbatim)
                                 for t in m.tool_calls]
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def template_messages(conv: Conversation, upto: int | None = None, *, arguments_json: bool = False,
                      verbatim_arguments: bool = False, reasoning_key: str = "reasoning_content",
                      developer: bool = True, tool_ids: str = "given",
                      inline_reasoning: bool = False) -> list[dict[str, Any]]:
    """Messages as template dicts, system first, ``conv.messages[:upto]`` (fields as in
    :func:`message_dict`; ``developer=False`` hands a developer prompt over as system;
    ``tool_ids="functions"`` renames tool-call ids as :func:`functions_ids` does)."""
    role = conv.system_role if developer else "system"
    head = [{"role": role, "content": conv.system}] if conv.system is not None else []
    out = [message_dict(m, arguments_json=arguments_json, verbatim=verbatim_arguments,
                        reasoning_key=reasoning_key, inline_reasoning=inline_reasoning) for m in conv.messages[:upto]]
    if tool_ids == "functions":
        calls, results = functions_ids(conv.messages)
        for i, m in enumerate(out):
            for j, call in enumerate(m.get("tool_calls", ())):
                call["id"] = calls[i, j]
            if i in results:
                m["tool_call_id"] = results[i]
    return head + out


def template_tools(conv: Conversation) -> list[dict[str, Any]] | None:
    """The ``tools`` argument of ``apply_chat_template``: the record's tools, or None when it gave none. A
    conversation whose messages carry tool lists of their own is rendered turn by turn, each with the tools
    that turn saw (:meth:`~onepass.conversation.parse.Conversation.at_turn`), never whole."""
    assert not conv.tool_changes, "render Conversation.at_turn(k): its messages carry tool lists of their own"
    return list(conv.tools) if conv.tools else None


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
