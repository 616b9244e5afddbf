"""What a chat template expects of a message's fields, found by rendering probes once per template.

Why this module exists: OpenAI-style records give a tool call's ``arguments``
as a JSON string, most templates (Qwen3, gpt-oss, GLM) want a dict and render
it with ``tojson`` or item by item, and the DeepSeek-V3 / Kimi-K2 templates
concatenate it as a string (a dict makes them raise ``can only concatenate
str (not "dict")``). Reasoning is read from ``reasoning_content`` (Qwen3,
DeepSeek, GLM), ``thinking`` (gpt-oss, LFM2.5), ``reasoning``, or ``tool_plan`` (Command R7B's
``tool_use`` template, on tool-call turns only: probed on a tool-call turn when no answer renders it).
A tokenizer with several named templates (a dict ``chat_template``: Command R7B's ``default``,
``tool_use``, ``rag``) renders with ``tool_use`` when tools are passed, as transformers picks it
(``get_chat_template``): the fields are probed per choice (:func:`template_fields` ``tools``). A record's
``developer`` prompt goes over as ``developer`` where the template renders that
role (gpt-oss), else as ``system`` (Qwen3 would drop it silently). The Kimi-K2 templates render
a tool call by its id alone, so an OpenAI id (``call_0``) hides the tool's name: there the ids are
handed over in Kimi's form, ``functions.NAME:IDX``. A record's
JSON-string arguments go over byte for byte where the template renders a string as it is (Qwen3's
``arguments is string`` branch, DeepSeek, Kimi-K2: ``string_arguments``); only a template that
needs a dict gets them parsed (counted in ``PrepareStats.tool_arguments_parsed``). Rather than
guessing from the template's name, each candidate is rendered once on a tiny
conversation and the first one the template renders faithfully is used for
every record (:func:`template_fields`, cached per template text and kwargs).

Worked example (a template that concatenates arguments as text)::

    >>> import jinja2
    >>> class Tok:  # stands in for a HF tokenizer
    ...     chat_template = ("{% for m in messages %}{% for c in m.tool_calls or [] %}<call>"
    ...                      "{{ c.function.name + ' ' + c.function.arguments }}</call>{% endfor %}"
    ...                      "{{ m.thinking }}{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}")
    ...     def apply_chat_template(self, messages, tools=None, tokenize=False, add_generation_prompt=False):
    ...         return jinja2.Environment().from_string(self.chat_template).render(
    ...             messages=messages, add_generation_prompt=add_generation_prompt)
    >>> template_fields(Tok(), {})  # doctest: +NORMALIZE_WHITESPACE
    TemplateFields(arguments='json', reasoning_key='thinking', developer=True, tool_ids='given',
                   generation_always=False, string_arguments=True, reads_reasoning=True)

No torch here: this is pure data.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from onepass.render.template import render_or_none

TEMPLATE_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning", "tool_plan")
"""The message keys a template may read reasoning from, in the order they are probed (the first one
rendered wins): every key a record may give reasoning under (:data:`onepass.conversation.schemas.REASONING_KEYS`,
a reading concern) plus ``tool_plan``, which only Command R7B's ``tool_use`` template reads."""
ARGUMENT_KINDS = ("dict", "json")
TOOL_ID_KINDS = ("given", "functions")  # the record's ids, or Kimi-K2's functions.NAME:IDX
_KEY, _VALUE, _REASONING = "onepass_probe_key", "onepass_probe_value", "onepass probe reasoning"
_TOOLS = "onepass_probe_tools"  # in a probe's kwargs: the tool list every probe passes (not a template kwarg)
_CACHE: dict[tuple[str, str, bool], TemplateFields] = {}


@dataclass(frozen=True, kw_only=True, slots=True)
class TemplateFields:
    """How messages are handed to one template: tool-call ``arguments`` as a ``dict`` or a ``json``
    string, and the message key the template reads reasoning from."""

    arguments: str = "dict"
    reasoning_key: str = "reasoning_content"
    developer: bool = False  # the template renders a "developer" message (else a developer prompt goes as system)
    tool_ids: str = "given"  # "functions": ids renamed functions.NAME:IDX (the template renders a call by its id)
    generation_always: bool = False  # appends its generation prompt to a finished conversation too (R7B tool_use)
    string_arguments: bool = False  # renders a JSON-string ``arguments`` as it is (Qwen3, Kimi-K2, DeepSeek)
    reads_reasoning: bool = True  # False: no probe renders reasoning under any key (SmolLM3, non-thinking templates):
    # a content the record gave as ``<think>r</think>a`` then goes over as given (template_messages, inline_reasoning)

    @property
    def arguments_json(self) -> bool:
        return self.arguments == "json"

    @property
    def message_options(self) -> dict[str, Any]:
        """Keyword arguments of :func:`onepass.render.messages.template_messages`."""
        return {"arguments_json": self.arguments_json, "verbatim_arguments": self.string_arguments,
                "reasoning_key": self.reasoning_key, "developer": self.developer, "tool_ids": self.tool_ids,
                "inline_reasoning": not self.reads_reasoning}


_TOOL = {"type": "function", "function": {"name": "onepass_probe", "description": "probe",
                                          "parameters": {"type": "object", "properties": {
                                              _KEY: {"type": "string"}}}}}


def _render(tokenizer: Any, messages: list[dict[str, Any]], kwargs: Mapping[str, Any],
            tools: list[dict[str, Any]] | None = None) -> str | None:
    tools = tools or kwargs.get(_TOOLS)
    kwargs = {"add_generation_prompt": False, **{k: v for k, v in kwargs.items() if k != _TOOLS}}
    return render_or_none(tokenizer, messages, tools=tools, kwargs=kwargs)


def _arguments_ok(tokenizer: Any, kind: str, kwargs: Mapping[str, Any]) -> bool:
    args: Any = {_KEY: _VALUE}
    if kind == "json":
        args = json.dumps(args)
    messages = [
        {"role": "user", "content": "probe"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": "call_0", "function": {"name": "onepass_probe", "arguments": args}}]},
        {"role": "tool", "content": "probe result", "tool_call_id": "call_0", "name": "onepass_probe"},
        {"role": "assistant", "content": "done"},
    ]
    text = _render(tokenizer, messages, kwargs, tools=[_TOOL])
    if text is None or _KEY not in text or _VALUE not in text:
        return False
    # A string re-encoded with tojson ("{\"k\"...") or a dict printed as Python ("{'k'...") is wrong.
    return f'\\"{_KEY}' not in text and f"'{_KEY}'" not in text


def _reasoning_ok(tokenizer: Any, key: str, kwargs: Mapping[str, Any], arguments: str = "", *,
                  tool_call: bool = False) -> bool:
    """Is reasoning under ``key`` rendered on a last answer (or, ``tool_call``, on a tool-call turn)?"""
    turn: dict[str, Any] = {"role": "assistant", "content": "answer", key: _REASONING}
    if tool_call:
        turn["tool_calls"] = [{"type": "function", "id": "call_0", "function": {
            "name": "onepass_probe", "arguments": "{}" if arguments == "json" else {}}}]
    text = _render(tokenizer, [{"role": "user", "content": "probe"}, turn], kwargs)
    return text is not None and _REASONING in text


def _developer_ok(tokenizer: Any, kwargs: Mapping[str, Any]) -> bool:
    """Does the template render a leading "developer" message (gpt-oss)? Qwen3 drops it silently."""
    marker = "onepass probe developer"
    text = _render(tokenizer, [{"role": "developer", "content": marker}, {"role": "user", "content": "probe"},
                               {"role": "assistant", "content": "answer"}], kwargs)
    return text is not None and marker in text


def _tool_ids_ok(tokenizer: Any, kind: str, arguments: str, kwargs: Mapping[str, Any]) -> bool:
    """Is a tool call's name rendered when its id has this form? (No tool list and no name on the
    result, so the call itself is the only place the name can come from.)"""
    call_id = "functions.onepass_probe:0" if kind == "functions" else "call_0"
    messages = [
        {"role": "user", "content": "probe"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": call_id, "function": {
                "name": "onepass_probe", "arguments": "{}" if arguments == "json" else {}}}]},
        {"role": "tool", "content": "probe result", "tool_call_id": call_id},
        {"role": "assistant", "content": "done"},
    ]
    text = _render(tokenizer, messages, kwargs)
    return text is not None and "onepass_probe" in text


def probe_fields(tokenizer: Any, kwargs: Mapping[str, Any]) -> TemplateFields:
    """Uncached :func:`template_fields`: the first candidate of each field that renders faithfully
    (defaults when none does: the turn's own checks then report what is not rendered)."""
    arguments = next((k for k in ARGUMENT_KINDS if _arguments_ok(tokenizer, k, kwargs)), "dict")
    reasoning = next((k for k in TEMPLATE_REASONING_KEYS if _reasoning_ok(tokenizer, k, kwargs)), None) or next(
        (k for k in TEMPLATE_REASONING_KEYS if _reasoning_ok(tokenizer, k, kwargs, arguments, tool_call=True)), None)
    tool_ids = next((k for k in TOOL_ID_KINDS if _tool_ids_ok(tokenizer, k, arguments, kwargs)), "given")
    probe = [{"role": "user", "content": "probe"}]  # the generation prompt rendered without being asked for?
    always = _render(tokenizer, probe, kwargs) == _render(tokenizer, probe, {**kwargs, "add_generation_prompt": True})
    strings = arguments == "json" or _arguments_ok(tokenizer, "json", kwargs)
    return TemplateFields(arguments=arguments, reasoning_key=reasoning or "reasoning_content",
                          developer=_developer_ok(tokenizer, kwargs), tool_ids=tool_ids, generation_always=always,
                          string_arguments=strings, reads_reasoning=reasoning is not None)


def template_fields(tokenizer: Any, kwargs: Mapping[str, Any], *, tools: bool = False) -> TemplateFields:
    """:func:`probe_fields`, once per template text and template kwargs; ``tools``: for a conversation
    with tools, which matters only where the tokenizer has named templates (a dict with ``tool_use``,
    picked by transformers when tools are passed): every probe then passes a tool."""
    template = getattr(tokenizer, "chat_template", None)
    selects = tools and isinstance(template, Mapping) and "tool_use" in template
    key = (str(template), json.dumps(dict(kwargs), sort_keys=True, default=str), bool(selects))
    if key not in _CACHE:
        _CACHE[key] = probe_fields(tokenizer, {**kwargs, _TOOLS: [_TOOL]} if selects else kwargs)
    return _CACHE[key]
