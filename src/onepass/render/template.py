"""The chat template call: the one place ``apply_chat_template`` is called.

Why this module exists: rendering calls the template for a view's prompt and full text, for the
probes that find the message fields (:mod:`onepass.render.fields`), the derived format
(:mod:`onepass.render.derived`) and dropped history reasoning (:mod:`onepass.render.reasoning`).
Those calls differ only in what they do when the template raises: a view's render names the turn
and the template line (:class:`~onepass.render.errors.TemplateRaised`), a probe reads "nothing
found" (None). Errors that come from onepass or transformers rather than the template propagate.

The date the template sees is a setting (:mod:`onepass.render.clock`): ``kwargs`` carry it under
:data:`~onepass.render.clock.TEMPLATE_DATE`, and a template that reads the clock is rendered with it
pinned; a template that draws random text is refused here, at every call (dated or not). jinja puts the template's own line number in a traceback under the file name ``<template>``
(:func:`template_line`, which counts the template's own lines, not the pinning macro's).

No torch here: this is pure data.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

from onepass.conversation.parse import Conversation
from onepass.errors import UsageError
from onepass.render.clock import PINNED_LINES, TEMPLATE_DATE, check_pinnable, pinned_template, reads_clock
from onepass.render.errors import RenderError, TemplateRaised
from onepass.render.tools_block import render_with, tools_block
from onepass.render.messages import template_tools

RESERVED_KWARGS = {
    **dict.fromkeys(("conversation", "messages", "tools", "documents"), "onepass passes the record's"),
    **dict.fromkeys(("add_generation_prompt", "continue_final_message"), "onepass sets it for each view"),
    **dict.fromkeys(("chat_template",), "use --chat-template"),
    TEMPLATE_DATE: "use --template-date",
    **dict.fromkeys(("tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors",
                     "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"),
                    "an argument of apply_chat_template, not a template variable"),
}
"""Names a template kwarg may not take, and why: ``apply_chat_template``'s own arguments (its signature, checked
against the installed transformers by tests/faults/test_one_line_data.py) and the variables onepass fills."""


def check_template_kwargs(kwargs: Mapping[str, Any]) -> None:
    """Refuse a template kwarg named as one of :data:`RESERVED_KWARGS` in one line: it would raise deep in
    transformers (``messages``, ``tokenize``) or be overridden silently (``add_generation_prompt``).

    >>> check_template_kwargs({"enable_thinking": False})
    >>> check_template_kwargs({"tools": []})
    Traceback (most recent call last):
    ...
    onepass.errors.UsageError: --template-kwarg tools is reserved (onepass passes the record's): a template kwarg is \
a variable of the template itself, such as enable_thinking
    """
    for name in kwargs:
        if name in RESERVED_KWARGS:
            raise UsageError(f"--template-kwarg {name} is reserved ({RESERVED_KWARGS[name]}): a template kwarg is "
                             "a variable of the template itself, such as enable_thinking")


Render = Callable[[list[dict[str, Any]], bool], "str | None"]
"""``render(messages, add_generation_prompt)``: the template's text, or None when it raised."""


def apply_template(tokenizer: Any, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None,
                   kwargs: Mapping[str, Any], tokenize: bool = False) -> Any:
    """The tokenizer's chat template on ``messages`` as text (``kwargs``: ``add_generation_prompt``, the
    template kwargs and the pinned date, :data:`~onepass.render.clock.TEMPLATE_DATE`). Raises what the
    template raises; may return a non-str (batched input). ``tokenize``: the tokenized dict instead
    (``input_ids``, and ``assistant_masks`` when ``kwargs`` ask for them: TRL's rows,
    :mod:`onepass.train.core.sft_rows`). Text is rendered with the tools once per distinct value where the
    template allows it (:mod:`onepass.render.tools_block`)."""
    kwargs = dict(kwargs)
    out = {"tokenize": True, "return_dict": True} if tokenize else {"tokenize": False}
    date = kwargs.pop(TEMPLATE_DATE, None)
    template = _template_text(tokenizer, kwargs.get("chat_template"), tools)
    if template is not None:
        check_pinnable(template)  # random text: refused, dated or not
    pinned = date is not None and template is not None and reads_clock(template)
    if pinned:
        template = pinned_template(template, date)
        kwargs["chat_template"] = template

    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Any:
        try:
            return tokenizer.apply_chat_template(messages, tools=tools, **out, **kwargs)
        except Exception as e:
            if pinned:
                e.onepass_pinned_lines = PINNED_LINES  # type: ignore[attr-defined]  # template_line: the template's own
            raise

    if tools and not tokenize:
        block = tools_block(tokenizer, template, tools, render)
        if block is not None:
            return render_with(block, messages, tools, render)
    return render(messages, tools)


def _template_text(tokenizer: Any, name: str | None, tools: list[dict[str, Any]] | None) -> str | None:
    """The template text ``apply_chat_template`` picks for ``tools`` (a tokenizer may hold several, by name;
    ``name``: a template or a name given), or None where there is none (the call then fails as unpinned)."""
    try:
        template = tokenizer.get_chat_template(name, tools)
    except (AttributeError, ValueError):
        return None
    return template if isinstance(template, str) else None


def template_line(error: BaseException) -> int | None:
    """The chat template's line where ``error`` was raised (None when it is not from a template)."""
    line = getattr(error, "lineno", None) if error.__class__.__name__ == "TemplateSyntaxError" else None
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line - getattr(error, "onepass_pinned_lines", 0) if line is not None else None


def is_template_error(error: BaseException) -> bool:
    """True when ``error`` comes from the template's own code (``raise_exception``, a jinja error,
    a type error in an expression), not from onepass or transformers."""
    try:
        from jinja2.exceptions import TemplateError
    except ImportError:  # pragma: no cover - transformers depends on jinja2
        TemplateError = ()
    return isinstance(error, TemplateError) or template_line(error) is not None


def render_or_none(tokenizer: Any, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None,
                   kwargs: Mapping[str, Any]) -> str | None:
    """:func:`apply_template`, or None where the template raises or returns no text (a probe found nothing)."""
    try:
        text = apply_template(tokenizer, messages, tools=tools, kwargs=kwargs)
    except Exception as e:
        if is_template_error(e):
            return None
        raise
    return text if isinstance(text, str) else None


def _raised(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
            kwargs: Mapping[str, Any]) -> str | None:
    """The template's error rendering ``messages`` (None when it renders them)."""
    try:
        apply_template(tokenizer, messages, tools=tools, kwargs=kwargs)
    except Exception as e:
        if not is_template_error(e):
            raise
        return str(e)
    return None


def _blame(tokenizer: Any, conv: Conversation, messages: list[dict[str, Any]], kwargs: Mapping[str, Any],
           error: str, turn: int, memo: dict[Any, Any] | None = None) -> str:
    """What the template raises ``error`` for, as a clause of the skip line: the record's tools list when the
    first prefix that raises renders without it (Apertus reads a tool's ``description`` at the top level:
    every message would be blamed), else the first message whose rendering raises it (gpt-oss: a later turn
    skipped because its prompt holds that message names the one to fix); "" for the turn itself.

    ``memo`` (one per conversation: the same tools and template kwargs) keeps each prefix's outcome by its
    content, so the scan is not repeated for every later turn that raises, nor for a retry's history that
    shares the prefix: without it, each raising turn re-rendered every prefix up to the culprit."""
    head = 1 if conv.system is not None else 0  # the system prompt is not one of conv.messages
    tools = template_tools(conv)
    memo = {} if memo is None else memo
    key = b""
    for n in range(1, len(messages) + 1):
        key = hashlib.sha256(key + json.dumps(messages[n - 1], sort_keys=True, default=str).encode()).digest()
        if key not in memo:
            memo[key] = _raised(tokenizer, messages[:n], tools, kwargs)
        if memo[key] != error:
            continue
        if tools and _raised(tokenizer, messages[:n], None, kwargs) is None:
            return (f" with the record's tools list ({len(tools)} tool{'s' * (len(tools) > 1)}), which the template "
                    "raises for (the messages render without it)")
        culprit = n - 1 - head
        if culprit >= 0 and culprit != turn:
            return f", which holds message {culprit + conv.first_message}, the first the template raises for"
        return ""
    return ""


def render_turn(tokenizer: Any, conv: Conversation, messages: list[dict[str, Any]], *, generation: bool,
                kwargs: Mapping[str, Any], turn: int, blame: bool = False, memo: dict[Any, Any] | None = None) -> str:
    """The template's text for ``messages`` of ``conv``, or :class:`TemplateRaised` naming turn ``turn``,
    the template line and (``blame``) what the template raises for: the record's tools list or the first
    message (:func:`_blame`, with its ``memo``)."""
    try:
        text = apply_template(tokenizer, messages, tools=template_tools(conv),
                              kwargs={**kwargs, "add_generation_prompt": generation})
    except Exception as e:
        if not is_template_error(e):
            raise
        line = template_line(e)
        at = f" at line {line}" if line is not None else ""
        what = "prompt" if generation else "conversation"
        if blame:
            what += _blame(tokenizer, conv, messages, kwargs, str(e), turn, memo)
        raise TemplateRaised(f"{conv.at(turn)}: the chat template raised{at} rendering "
                             f"the {what}: {type(e).__name__}: {e}") from None
    if not isinstance(text, str):  # transformers may return a list for batched input
        raise RenderError(f"{conv.source}: the chat template returned {type(text).__name__}, not text")
    return text


def prober(tokenizer: Any, conv: Conversation, kwargs: Mapping[str, Any], turn: int) -> Render:
    """A :data:`Render` over ``conv``'s tools: None where the template raises (a probe then finds nothing)."""
    def render(messages: list[dict[str, Any]], generation: bool) -> str | None:
        try:
            return render_turn(tokenizer, conv, messages, generation=generation, kwargs=kwargs, turn=turn)
        except RenderError:
            return None
    return render
