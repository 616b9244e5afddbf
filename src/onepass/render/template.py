"""The chat template call: the one place ``apply_chat_template`` is called.

Why this module exists: rendering calls the template for a view's prompt and full text, for the
probes that find the message fields (:mod:`onepass.render.fields`), the derived format
(:mod:`onepass.render.derived`) and dropped history reasoning (:mod:`onepass.render.reasoning`).
Those calls differ only in what they do when the template raises: a view's render names the turn
and the template line (:class:`~onepass.render.errors.TemplateRaised`), a probe reads "nothing
found" (None). Errors that come from onepass or transformers rather than the template propagate.

jinja puts the template's own line number in a traceback under the file name ``<template>``
(:func:`template_line`).

No torch here: this is pure data.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from onepass.conversation import Conversation
from onepass.render.errors import RenderError, TemplateRaised
from onepass.render.tools_block import render_with, tools_block
from onepass.template_messages import template_tools

Render = Callable[[list[dict[str, Any]], bool], "str | None"]
"""``render(messages, add_generation_prompt)``: the template's text, or None when it raised."""


def apply_template(tokenizer: Any, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None,
                   kwargs: Mapping[str, Any]) -> Any:
    """The tokenizer's chat template on ``messages`` as text (``kwargs``: ``add_generation_prompt`` and the
    template kwargs). Raises what the template raises; may return a non-str (batched input). Tools are
    rendered once per distinct value where the template allows it (:mod:`onepass.render.tools_block`)."""
    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Any:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)

    if tools:
        block = tools_block(tokenizer, tools, render)
        if block is not None:
            return render_with(block, messages, tools, render)
    return render(messages, tools)


def template_line(error: BaseException) -> int | None:
    """The chat template's line where ``error`` was raised (None when it is not from a template)."""
    line = getattr(error, "lineno", None) if error.__class__.__name__ == "TemplateSyntaxError" else None
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


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


def _first_raising(tokenizer: Any, conv: Conversation, messages: list[dict[str, Any]],
                   kwargs: Mapping[str, Any], error: str) -> int | None:
    """The first message (numbered as in errors) whose rendering makes the template raise ``error``:
    a later turn skipped because its prompt holds that message (gpt-oss) names the one to fix."""
    head = 1 if conv.system is not None else 0  # the system prompt is not one of conv.messages
    for n in range(1, len(messages) + 1):
        try:
            apply_template(tokenizer, messages[:n], tools=template_tools(conv), kwargs=kwargs)
        except Exception as e:
            if not is_template_error(e):
                raise
            if str(e) == error:
                return n - 1 - head
    return None


def render_turn(tokenizer: Any, conv: Conversation, messages: list[dict[str, Any]], *, generation: bool,
                kwargs: Mapping[str, Any], turn: int, blame: bool = False) -> str:
    """The template's text for ``messages`` of ``conv``, or :class:`TemplateRaised` naming turn ``turn``,
    the template line and (``blame``) the first message the template raises for."""
    try:
        text = apply_template(tokenizer, messages, tools=template_tools(conv),
                              kwargs={**kwargs, "add_generation_prompt": generation})
    except Exception as e:
        if not is_template_error(e):
            raise
        line = template_line(e)
        at = f" at line {line}" if line is not None else ""
        what = "prompt" if generation else "conversation"
        culprit = _first_raising(tokenizer, conv, messages, kwargs, str(e)) if blame else None
        if culprit is not None and culprit >= 0 and culprit != turn:
            what += f", which holds message {culprit + conv.first_message}, the first the template raises for"
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
