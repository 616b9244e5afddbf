"""Views: one training example per assistant turn, rendered by the model's own template.

Why this module exists: the N-pass example for assistant turn k is exactly what
the model sees at inference (the prompt, rendered by its chat template with the
generation prompt) followed by what it generates. Rendering with the template,
instead of assuming a format, is what makes onepass exact for any template:
Qwen3 dropping old reasoning, keeping it inside a tool-call chain, the empty
``<think>\\n\\n</think>\\n\\n`` block on a turn without reasoning, all come from
the template itself.

For assistant message k::

    prompt_k     = render(messages[:k], add_generation_prompt=True)
    full_k       = render(messages[:k+1])
    completion_k = full_k[len(prompt_k):]           if full_k starts with prompt_k
                 = completion_format.format(...)     if a format is given
                 (else: RenderError naming the turn)
    tokens_k     = tokenize(prompt_k) + tokenize(completion_k)   (each on its own)

Tokenizing the two parts on their own is what happens at inference (the prompt
is encoded, then the model emits tokens); it differs from tokenizing ``full_k``
when a BPE merge crosses the boundary. Such views are counted
(``View.boundary_merge``).

A turn that cannot be split, or for which the template raises, is skipped on
its own (:func:`render_conversation` returns it with its error, naming record,
message and template line); the conversation's other views are well defined
and kept. Message fields are handed over as the template reads them (tool-call
arguments as a dict or a JSON string, reasoning under ``reasoning_content`` /
``thinking`` / ``reasoning``): :mod:`onepass.template_probe`.

Worked example (Qwen3, reasoning "r", answer "a")::

    prompt      <|im_start|>user\\nq<|im_end|>\\n<|im_start|>assistant\\n
    completion  <think>\\nr\\n</think>\\n\\na<|im_end|>\\n        <- trained tokens

No torch here: this is pure data.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from onepass.conversation import Conversation, Message
from onepass.errors import DataError, UsageError
from onepass.template_probe import (
    TemplateFields,
    is_template_error,
    template_fields,
    template_line,
)

COMPLETION_FORMATS: dict[str, str] = {
    # DeepSeek-R1 style templates strip reasoning from every assistant turn and end
    # the generation prompt with "<think>\n": the model generates the rest.
    "deepseek-r1": "{reasoning}\n</think>\n\n{content}{eos}",
    # A template whose generation prompt ends with the assistant header only.
    "think-tags": "<think>\n{reasoning}\n</think>\n\n{content}{tool_calls}{eos}",
}
"""Named completion formats. Fields: ``{reasoning}`` (empty string when absent),
``{content}``, ``{tool_calls}`` (Qwen-style ``<tool_call>`` blocks, each on a
new line) and ``{eos}`` (the tokenizer's EOS token). Any other string with these
fields is accepted as a format too."""


class RenderError(DataError):
    """A turn the template cannot split into prompt and completion (counted as ``reason``)."""

    reason = "template"


class TemplateRaised(RenderError):
    """The chat template itself raised (``raise_exception``, a jinja error) for one turn."""

    reason = "template error"


@dataclass(frozen=True, kw_only=True, slots=True)
class View:
    """One N-pass training example: ``tokens[:num_prompt]`` is context, the rest is trained."""

    tokens: np.ndarray  # int64 [n]
    num_prompt: int
    turn: int  # index of the assistant message in Conversation.messages
    source: str = "<memory>"
    boundary_merge: bool = False  # tokenizing prompt+completion as one text gives other tokens

    @property
    def num_completion(self) -> int:
        return len(self.tokens) - self.num_prompt

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True, kw_only=True)
class RenderConfig:
    """How to render views. ``template_kwargs`` go to the template (e.g. ``enable_thinking``)."""

    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    completion_format: str | None = None  # a name from COMPLETION_FORMATS or a format string


def parse_key_value(text: str, *, flag: str = "--template-kwarg") -> tuple[str, Any]:
    """``KEY=VALUE`` -> ``(KEY, VALUE)``; VALUE is parsed as JSON when it can be (true, 3, "x"),
    else kept as text. Every ``KEY=VALUE`` flag of every subcommand (``--template-kwarg``) reads through this.

    >>> parse_key_value("enable_thinking=false"), parse_key_value("name=qwen 3")
    (('enable_thinking', False), ('name', 'qwen 3'))
    """
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise UsageError(f"{flag} expects KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def template_kwargs(pairs: Sequence[str]) -> dict[str, Any]:
    """``--template-kwarg KEY=VALUE`` pairs (:func:`parse_key_value`) as a dict."""
    return dict(parse_key_value(pair) for pair in pairs)


def resolve_completion_format(spec: str | None) -> str | None:
    if spec is None:
        return None
    fmt = COMPLETION_FORMATS.get(spec, spec)
    try:
        fmt.format(reasoning="", content="", tool_calls="", eos="")
    except (KeyError, IndexError, ValueError) as e:
        raise RenderError(f"bad completion format {spec!r}: {e!r}; fields are "
                          "{reasoning} {content} {tool_calls} {eos}, or one of "
                          + ", ".join(COMPLETION_FORMATS)) from None
    return fmt


def format_completion(fmt: str, message: Message, eos: str) -> str:
    calls = "".join(
        "\n<tool_call>\n" + json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False)
        + "\n</tool_call>" for c in message.tool_calls)
    return fmt.format(reasoning=message.reasoning or "", content=message.content,
                      tool_calls=calls, eos=eos)


def _render(tokenizer: Any, conv: Conversation, upto: int, *, generation: bool,
            kwargs: Mapping[str, Any], fields: TemplateFields, turn: int) -> str:
    messages = conv.template_messages(upto, arguments_json=fields.arguments_json,
                                      reasoning_key=fields.reasoning_key)
    try:
        text = tokenizer.apply_chat_template(messages, tools=conv.template_tools(), tokenize=False,
                                             add_generation_prompt=generation, **kwargs)
    except Exception as e:
        if not is_template_error(e):
            raise
        line = template_line(e)
        at = f" at line {line}" if line is not None else ""
        what = "prompt" if generation else "conversation"
        raise TemplateRaised(f"{conv.source}, message {turn}: the chat template raised{at} rendering "
                             f"the {what}: {type(e).__name__}: {e}") from None
    if not isinstance(text, str):  # transformers may return a list for batched input
        raise RenderError(f"{conv.source}: the chat template returned {type(text).__name__}, not text")
    return text


def render_prompt(conv: Conversation, tokenizer: Any, upto: int,
                  template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The prompt the model sees before message ``upto``: ``messages[:upto]`` with the generation
    prompt, with the fields this template expects (:func:`onepass.template_probe.template_fields`),
    exactly as training renders a view's prompt. Inference-time callers (``onepass eval``) use it."""
    kwargs = dict(template_kwargs or {})
    return _render(tokenizer, conv, upto, generation=True, kwargs=kwargs,
                   fields=template_fields(tokenizer, kwargs), turn=upto)


def _turn_text(conv: Conversation, k: int, tokenizer: Any, fmt: str | None, kwargs: Mapping[str, Any],
               fields: TemplateFields, eos: str) -> tuple[str, str]:
    """``(prompt, completion)`` of assistant message ``k``, or RenderError naming the turn."""
    message = conv.messages[k]
    prompt = _render(tokenizer, conv, k, generation=True, kwargs=kwargs, fields=fields, turn=k)
    if fmt is not None:
        if message.tool_calls and "{tool_calls}" not in fmt:
            raise RenderError(f"{conv.source}, message {k}: the completion format has no {{tool_calls}} "
                              "field, so this turn's tool calls would never be trained")
        completion = format_completion(fmt, message, eos)
    else:
        full = _render(tokenizer, conv, k + 1, generation=False, kwargs=kwargs, fields=fields, turn=k)
        if not full.startswith(prompt):
            raise RenderError(
                f"{conv.source}, message {k}: the chat template's rendering of the conversation "
                "up to this assistant turn does not start with its own generation prompt, so "
                "prompt and completion cannot be split (DeepSeek-R1 style templates do this). "
                "Pass a completion format, e.g. --completion-format deepseek-r1")
        completion = full[len(prompt):]
        reasoning = (message.reasoning or "").strip()
        if reasoning and reasoning not in completion:
            raise RenderError(
                f"{conv.source}, message {k}: the chat template does not render this turn's "
                "reasoning, so it would never be trained. Pass a completion format "
                "(e.g. --completion-format think-tags) or a template that renders "
                f"{fields.reasoning_key} on the last turn")
        missing = [c.name for c in message.tool_calls if c.name not in completion]
        if missing:
            raise RenderError(f"{conv.source}, message {k}: the chat template does not render this "
                              f"turn's tool call {missing[0]!r}, so it would never be trained")
    if not completion:
        raise RenderError(f"{conv.source}, message {k}: the completion is empty")
    return prompt, completion


def _iter_texts(conv: Conversation, tokenizer: Any, config: RenderConfig
                ) -> Iterator[tuple[int, str, str] | tuple[int, RenderError]]:
    """Per assistant turn: ``(turn, prompt, completion)``, or ``(turn, the RenderError that skips it)``."""
    fmt = resolve_completion_format(config.completion_format)
    kwargs = dict(config.template_kwargs)
    eos = getattr(tokenizer, "eos_token", None) or ""
    fields = template_fields(tokenizer, kwargs)
    for k, message in enumerate(conv.messages):
        if message.role != "assistant":
            continue
        try:
            yield (k, *_turn_text(conv, k, tokenizer, fmt, kwargs, fields, eos))
        except RenderError as e:
            yield k, e


def render_texts(conv: Conversation, tokenizer: Any, config: RenderConfig = RenderConfig()
                 ) -> list[tuple[int, str, str]]:
    """``(turn, prompt_text, completion_text)`` for every assistant message of ``conv``;
    raises the first turn's RenderError (:func:`render_conversation` skips that turn instead)."""
    out = []
    for item in _iter_texts(conv, tokenizer, config):
        if isinstance(item[1], RenderError):
            raise item[1]
        out.append(item)
    return out


def _encode(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    return tokenizer(list(texts), add_special_tokens=False)["input_ids"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Rendered:
    """The views of one conversation, and each turn that could not be used (with its error)."""

    views: tuple[View, ...]
    skipped: tuple[RenderError, ...] = ()


def render_conversation(conv: Conversation, tokenizer: Any, config: RenderConfig = RenderConfig()
                        ) -> Rendered:
    """Every view of ``conv`` that renders; a turn that does not is skipped on its own, with its
    error, and the conversation's other views are kept (a view depends on its own turn only)."""
    texts: list[tuple[int, str, str]] = []
    skipped: list[tuple[int, RenderError]] = []
    for item in _iter_texts(conv, tokenizer, config):
        (skipped if isinstance(item[1], RenderError) else texts).append(item)  # type: ignore[arg-type]
    if not texts:
        return Rendered(views=(), skipped=tuple(e for _, e in skipped))
    prompts = _encode(tokenizer, [p for _, p, _ in texts])
    completions = _encode(tokenizer, [c for _, _, c in texts])
    wholes = _encode(tokenizer, [p + c for _, p, c in texts])
    views = []
    for (turn, _, _), p, c, w in zip(texts, prompts, completions, wholes):
        if not c:
            skipped.append((turn, RenderError(f"{conv.source}, message {turn}: the completion has no tokens")))
        elif not p:
            skipped.append((turn, RenderError(f"{conv.source}, message {turn}: the prompt has no tokens, so "
                                              "the first completion token has nothing to be predicted from")))
        else:
            views.append(View(tokens=np.asarray(p + c, dtype=np.int64), num_prompt=len(p), turn=turn,
                              source=conv.source, boundary_merge=(p + c) != w))
    skipped.sort(key=lambda pair: pair[0])
    return Rendered(views=tuple(views), skipped=tuple(e for _, e in skipped))


def render_views(conv: Conversation, tokenizer: Any, config: RenderConfig = RenderConfig()
                 ) -> list[View]:
    """The N-pass views of ``conv``, in turn order; raises the first skipped turn's RenderError."""
    rendered = render_conversation(conv, tokenizer, config)
    if rendered.skipped:
        raise rendered.skipped[0]
    return list(rendered.views)
