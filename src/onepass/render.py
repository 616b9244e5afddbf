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
                 = the derived generation format     else (onepass.generation_format)
                 (else: RenderError naming the turn and what failed)
    tokens_k     = tokenize(prompt_k) + tokenize(completion_k)   (each on its own)

Tokenizing the two parts on their own is what happens at inference (the prompt is encoded, then the model
emits tokens); it differs from tokenizing ``full_k`` when a BPE merge crosses the boundary. Such views are
counted (``View.boundary_merge``, found on a window around the boundary: :func:`merges_across`). The prompts
of one conversation repeat its history: :mod:`onepass.encode` encodes each piece between added tokens once.

A turn that cannot be split, or for which the template raises, is skipped on its own (:func:`render_conversation`
returns it with its error, naming record, message and template line); the other views are kept. Message fields
go over as the template reads them (:mod:`onepass.template_probe`); reasoning is left out only where
:mod:`onepass.dropped_reasoning` says (``--reasoning drop``, or an earlier turn's the template drops anyway).

Worked example (Qwen3, reasoning "r", answer "a")::

    prompt      <|im_start|>user\\nq<|im_end|>\\n<|im_start|>assistant\\n
    completion  <think>\\nr\\n</think>\\n\\na<|im_end|>\\n        <- trained tokens

No torch here: this is pure data.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from onepass.conversation import Conversation
from onepass.dropped_reasoning import (
    REASONING_CHOICES,
    unrendered_history_reasoning,
    without_reasoning,
)
from onepass.encode import encode_texts, split_between
from onepass.errors import DataError, UsageError
from onepass.generation_format import (  # noqa: F401  (COMPLETION_FORMATS, format_completion: re-exported)
    COMPLETION_FORMATS,
    Render,
    completion_fields,
    derive_completion,
    format_completion,
    turn_end,
    unopened_close,
)
from onepass.key_value import parse_key_value  # noqa: F401  (re-exported: its home before)
from onepass.template_probe import (
    TemplateFields,
    is_template_error,
    template_fields,
    template_line,
)
from onepass.view import View

class RenderError(DataError):
    """A turn the template cannot split into prompt and completion (counted as ``reason``)."""

    reason = "template"


class ReasoningNotRendered(RenderError):
    """The template does not render the turn's reasoning (``--reasoning drop`` trains the turn without it)."""


class UnopenedReasoning(RenderError):
    """A completion format closes a reasoning block (``</think>``) that neither it nor the turn's generation
    prompt opens (DeepSeek-V3.1 thinking after a tool result): the target would close a tag never opened."""

    reason = "format not opened by the prompt"


class TemplateRaised(RenderError):
    """The chat template itself raised (``raise_exception``, a jinja error) for one turn."""

    reason = "template error"


@dataclass(frozen=True, kw_only=True)
class RenderConfig:
    """How to render views. ``template_kwargs`` go to the template (e.g. ``enable_thinking``)."""

    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    completion_format: str | None = None  # a name from COMPLETION_FORMATS or a format string
    reasoning: str = "keep"  # or "drop": a turn whose reasoning the template never renders is trained without it

    def __post_init__(self) -> None:
        if self.reasoning not in REASONING_CHOICES:
            raise UsageError(f"--reasoning must be one of {', '.join(REASONING_CHOICES)}, got {self.reasoning!r}")


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


def _render(tokenizer: Any, conv: Conversation, upto: int, *, generation: bool,
            kwargs: Mapping[str, Any], fields: TemplateFields, turn: int) -> str:
    messages = conv.template_messages(upto, **fields.message_options)
    return _apply(tokenizer, conv, messages, generation=generation, kwargs=kwargs, turn=turn, blame=True)


def _first_raising(tokenizer: Any, conv: Conversation, messages: list[dict[str, Any]],
                   kwargs: Mapping[str, Any], error: str) -> int | None:
    """The first message (numbered as in errors) whose rendering makes the template raise ``error``:
    a later turn skipped because its prompt holds that message (gpt-oss) names the one to fix."""
    head = 1 if conv.system is not None else 0  # the system prompt is not one of conv.messages
    for n in range(1, len(messages) + 1):
        try:
            tokenizer.apply_chat_template(messages[:n], tools=conv.template_tools(), tokenize=False, **kwargs)
        except Exception as e:
            if not is_template_error(e):
                raise
            if str(e) == error:
                return n - 1 - head
    return None


def _apply(tokenizer: Any, conv: Conversation, messages: list[dict[str, Any]], *, generation: bool,
           kwargs: Mapping[str, Any], turn: int, blame: bool = False) -> str:
    try:
        text = tokenizer.apply_chat_template(messages, tools=conv.template_tools(), tokenize=False,
                                             add_generation_prompt=generation, **kwargs)
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


def render_prompt(conv: Conversation, tokenizer: Any, upto: int,
                  template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The prompt the model sees before message ``upto``: ``messages[:upto]`` with the generation
    prompt, with the fields this template expects (:func:`onepass.template_probe.template_fields`),
    exactly as training renders a view's prompt. Inference-time callers (``onepass eval``) use it."""
    kwargs = dict(template_kwargs or {})
    return _render(tokenizer, conv, upto, generation=True, kwargs=kwargs,
                   fields=template_fields(tokenizer, kwargs, tools=bool(conv.tools)), turn=upto)


def _prober(tokenizer: Any, conv: Conversation, kwargs: Mapping[str, Any], turn: int) -> Render:
    """Render probe messages; None where the template raises (the probe then says it found nothing)."""
    def render(messages: list[dict[str, Any]], generation: bool) -> str | None:
        try:
            return _apply(tokenizer, conv, messages, generation=generation, kwargs=kwargs, turn=turn)
        except RenderError:
            return None
    return render


def _formatted(conv: Conversation, k: int, tokenizer: Any, fmt: str, kwargs: Mapping[str, Any],
               fields: TemplateFields, eos: str) -> str:
    """The completion from a ``--completion-format``, tool calls and end of turn as the template renders them."""
    message = conv.messages[k]
    if message.tool_calls and "{tool_calls}" not in fmt:
        raise RenderError(f"{conv.at(k)}: the completion format has no {{tool_calls}} "
                          "field, so this turn's tool calls would never be trained")
    messages = conv.template_messages(k + 1, **fields.message_options)
    read = completion_fields(_prober(tokenizer, conv, kwargs, k), messages[:-1], messages[-1],
                             reasoning_key=fields.reasoning_key)
    if read is None and message.tool_calls:
        raise RenderError(f"{conv.at(k)}: the chat template does not show how it renders this "
                          "turn's tool calls, so the completion format cannot fill {tool_calls}")
    calls, end = read if read is not None else (None, eos)
    prompt = _render(tokenizer, conv, k, generation=True, kwargs=kwargs, fields=fields, turn=k)
    if (closer := unopened_close(fmt, prompt)) is not None:
        raise UnopenedReasoning(
            f"{conv.at(k)}: the completion format closes {closer} but this turn's generation prompt does not open "
            f"{closer.replace('/', '')} (it ends {prompt[-40:]!r}; DeepSeek-V3.1 after a tool result), so the target "
            "would close a tag the model never opened: skipped (think-tags opens it itself)")
    names = [c.name for c in message.tool_calls]
    missing = [n for n in names if (calls or "").count(n) < names.count(n)]
    if missing and read is not None:
        raise RenderError(
            f"{conv.at(k)}: the chat template does not render this turn's tool call {missing[0]!r}, "
            "so the completion format cannot fill {tool_calls}. A template that renders tool calls only when "
            "the content is None (DeepSeek-R1-Distill) never does: transformers drops None-valued keys from "
            "every message before rendering, at inference too; such a turn cannot be trained with this template")
    return format_completion(fmt, message, end, calls)


def _derived(conv: Conversation, k: int, tokenizer: Any, kwargs: Mapping[str, Any], fields: TemplateFields,
             prompt: str) -> str:
    """The completion from the derived generation format, or the RenderError saying what failed."""
    message = conv.messages[k]
    messages = conv.template_messages(k + 1, **fields.message_options)
    result = derive_completion(_prober(tokenizer, conv, kwargs, k), messages[:-1], messages[-1], prompt,
                               reasoning_key=fields.reasoning_key, reasoning=message.reasoning or "",
                               content=message.content, tool_names=[c.name for c in message.tool_calls])
    if result.text is None:
        raise RenderError(
            f"{conv.at(k)}: the chat template's rendering of the conversation up to this "
            "assistant turn does not start with its own generation prompt, and no generation format could "
            f"be derived from the template ({result.problem}): "
            + (result.hint or "see onepass templates check"))
    return result.text


def _turn_end(conv: Conversation, k: int, completion: str, fields: TemplateFields, eos: str) -> str:
    """:func:`onepass.generation_format.turn_end`, or the RenderError saying why the end is not found."""
    end = turn_end(completion, eos) if fields.generation_always else completion
    if end is None:
        raise RenderError(f"{conv.at(k)}: the chat template appends its generation prompt even to a finished "
                          f"conversation, and the tokenizer's EOS token ({eos!r}) is not in this turn's rendering, "
                          "so where the turn ends cannot be read off")
    return end


def _split_turn(conv: Conversation, k: int, tokenizer: Any, fmt: str | None, kwargs: Mapping[str, Any],
                fields: TemplateFields, eos: str) -> tuple[str, str, bool]:
    """``(prompt, completion, derived)`` of assistant message ``k``, or RenderError naming the turn."""
    message = conv.messages[k]
    prompt = _render(tokenizer, conv, k, generation=True, kwargs=kwargs, fields=fields, turn=k)
    derived = False
    if fmt is not None:
        completion = _formatted(conv, k, tokenizer, fmt, kwargs, fields, eos)
    else:
        full = _render(tokenizer, conv, k + 1, generation=False, kwargs=kwargs, fields=fields, turn=k)
        reasoning = (message.reasoning or "").strip()
        if full.startswith(prompt) and reasoning in full[len(prompt):]:
            completion = _turn_end(conv, k, full[len(prompt):], fields, eos)
        else:  # not a prefix, or the split drops the turn's reasoning (Kimi-K2 on a final answer)
            try:
                completion, derived = _derived(conv, k, tokenizer, kwargs, fields, prompt), True
            except RenderError:
                if not full.startswith(prompt):
                    raise
                completion = full[len(prompt):]  # the reasoning check below says why it is skipped
        if reasoning and reasoning not in completion:
            raise ReasoningNotRendered(
                f"{conv.at(k)}: the chat template does not render this turn's reasoning "
                f"(looked for under {fields.reasoning_key!r}), so it would never be trained. Train the turn "
                "without it as a non-thinking model generates it (--reasoning drop), use a thinking template, "
                "or pass a completion format (--completion-format think-tags if the model writes <think> tags)")
        calls = Counter(c.name for c in message.tool_calls)
        missing = [name for name, n in calls.items() if completion.count(name) < n]
        if missing:
            raise RenderError(f"{conv.at(k)}: the chat template does not render this turn's "
                              f"{calls[missing[0]]} tool call(s) {missing[0]!r} (found {completion.count(missing[0])}), "
                              "so they would never be trained")
    if not completion:
        raise RenderError(f"{conv.at(k)}: the completion is empty")
    return prompt, completion, derived


@dataclass(frozen=True, slots=True)
class _Text:
    """One turn's texts, and how they were obtained (the View's flags)."""

    prompt: str
    completion: str
    derived: bool = False
    reasoning_dropped: bool = False
    history_reasoning_dropped: bool = False


def _turn_text(conv: Conversation, k: int, tokenizer: Any, fmt: str | None, kwargs: Mapping[str, Any],
               fields: TemplateFields, eos: str, reasoning: str) -> _Text:
    """The texts of assistant message ``k``, or the RenderError naming the turn. Reasoning is left out
    only where :mod:`onepass.dropped_reasoning` says so (by choice, or where the template drops it)."""
    split = (tokenizer, fmt, kwargs, fields, eos)
    try:
        return _Text(*_split_turn(conv, k, *split))
    except ReasoningNotRendered:
        if reasoning != "drop":
            raise
        return _Text(*_split_turn(without_reasoning(conv, [k]), k, *split), reasoning_dropped=True)
    except TemplateRaised as error:  # an earlier message the template raises for, in a position where it drops
        head = len(conv.template_messages(0))  # its reasoning anyway (gpt-oss): probed, never assumed
        dropped = unrendered_history_reasoning(_prober(tokenizer, conv, kwargs, k), conv, k, head=head,
                                               options=fields.message_options)
        if not dropped:
            raise
        try:
            return _Text(*_split_turn(without_reasoning(conv, dropped), k, *split), history_reasoning_dropped=True)
        except RenderError:
            raise error from None


def _iter_texts(conv: Conversation, tokenizer: Any, config: RenderConfig
                ) -> Iterator[tuple[int, _Text] | tuple[int, RenderError]]:
    """Per assistant turn: ``(turn, its texts)``, or ``(turn, the RenderError that skips it)``."""
    fmt = resolve_completion_format(config.completion_format)
    kwargs = dict(config.template_kwargs)
    eos = getattr(tokenizer, "eos_token", None) or ""
    fields = template_fields(tokenizer, kwargs, tools=bool(conv.tools))
    for k, message in enumerate(conv.messages):
        if message.role != "assistant" or not message.train:
            continue
        try:
            yield k, _turn_text(conv, k, tokenizer, fmt, kwargs, fields, eos, config.reasoning)
        except RenderError as e:
            yield k, e


def render_texts(conv: Conversation, tokenizer: Any, config: RenderConfig = RenderConfig()
                 ) -> list[tuple[int, str, str]]:
    """``(turn, prompt_text, completion_text)`` for every assistant message of ``conv``;
    raises the first turn's RenderError (:func:`render_conversation` skips that turn instead)."""
    out = []
    for turn, text in _iter_texts(conv, tokenizer, config):
        if isinstance(text, RenderError):
            raise text
        out.append((turn, text.prompt, text.completion))
    return out


BOUNDARY_WINDOW = 64  # characters each side of the prompt|completion boundary


def merges_across(tokenizer: Any, pairs: Sequence[tuple[str, str]], window: int = BOUNDARY_WINDOW) -> list[bool]:
    """Per ``(prompt, completion)``: does tokenizing them as one text give other tokens than each on its
    own? A BPE merge crosses the boundary only inside the pre-token holding it, so ``window`` characters
    each side decide it, without encoding the whole view a third time (the slow reference, the whole
    text, is compared with this in tests/test_render.py). Example: an R1 prompt ends ``<think>\\n`` and a
    completion with empty reasoning starts ``\\n</think>``; joined, ``\\n\\n`` is one Qwen token: True.
    A pair the tokenizer surely cuts at the boundary (an added token on either side:
    :func:`onepass.encode.split_between`) is False without encoding anything.
    """
    unknown = [i for i, (p, c) in enumerate(pairs) if not split_between(tokenizer, p, c)]
    texts = [t for i in unknown for p, c in [pairs[i]] for t in (p[-window:] + c[:window], p[-window:], c[:window])]
    ids = encode_texts(tokenizer, texts) if texts else []
    merged = [False] * len(pairs)
    for j, i in enumerate(unknown):
        merged[i] = ids[3 * j] != ids[3 * j + 1] + ids[3 * j + 2]
    return merged


@dataclass(frozen=True, kw_only=True, slots=True)
class Rendered:
    """The views of one conversation, and each turn that could not be used (with its error)."""

    views: tuple[View, ...]
    skipped: tuple[RenderError, ...] = ()
    not_trained: int = 0  # assistant turns the record marks not to train (weight 0): no view, context only
    arguments_parsed: int = 0  # tool calls given as a JSON string, parsed for a template that needs a dict


def _counts(conv: Conversation, tokenizer: Any, config: RenderConfig) -> dict[str, int]:
    """:class:`Rendered`'s counts of what the record says and the template needs, beside the views."""
    fields = template_fields(tokenizer, dict(config.template_kwargs), tools=bool(conv.tools))
    strings = sum(c.text is not None for m in conv.messages for c in m.tool_calls)
    return {"not_trained": sum(m.role == "assistant" and not m.train for m in conv.messages),
            "arguments_parsed": 0 if fields.string_arguments else strings}


def render_conversation(conv: Conversation, tokenizer: Any, config: RenderConfig = RenderConfig()
                        ) -> Rendered:
    """Every view of ``conv`` that renders; a turn that does not is skipped on its own, with its
    error, and the conversation's other views are kept (a view depends on its own turn only)."""
    texts: list[tuple[int, _Text]] = []
    skipped: list[tuple[int, RenderError]] = []
    for item in _iter_texts(conv, tokenizer, config):
        (skipped if isinstance(item[1], RenderError) else texts).append(item)  # type: ignore[arg-type]
    counts = _counts(conv, tokenizer, config)
    if not texts:
        return Rendered(views=(), skipped=tuple(e for _, e in skipped), **counts)
    encoded = encode_texts(tokenizer, [t.prompt for _, t in texts] + [t.completion for _, t in texts])
    prompts, completions = encoded[:len(texts)], encoded[len(texts):]
    merged = merges_across(tokenizer, [(t.prompt, t.completion) for _, t in texts])
    views = []
    for (turn, text), p, c, merge in zip(texts, prompts, completions, merged):
        if not c:
            skipped.append((turn, RenderError(f"{conv.at(turn)}: the completion has no tokens")))
        elif not p:
            skipped.append((turn, RenderError(f"{conv.at(turn)}: the prompt has no tokens, so "
                                              "the first completion token has nothing to be predicted from")))
        else:
            views.append(View(tokens=np.asarray(p + c, dtype=np.int64), num_prompt=len(p), turn=turn,
                              source=conv.source, boundary_merge=merge, derived=text.derived,
                              reasoning_dropped=text.reasoning_dropped, first_message=conv.first_message,
                              history_reasoning_dropped=text.history_reasoning_dropped))
    skipped.sort(key=lambda pair: pair[0])
    return Rendered(views=tuple(views), skipped=tuple(e for _, e in skipped), **counts)


def render_views(conv: Conversation, tokenizer: Any, config: RenderConfig = RenderConfig()
                 ) -> list[View]:
    """The N-pass views of ``conv``, in turn order; raises the first skipped turn's RenderError."""
    rendered = render_conversation(conv, tokenizer, config)
    if rendered.skipped:
        raise rendered.skipped[0]
    return list(rendered.views)
