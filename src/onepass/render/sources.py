"""Where a turn's completion comes from: the completion sources, tried in order, and the checks after.

Why this module exists: a view is ``prompt_k + completion_k``; the prompt is always the template's
rendering of ``messages[:k]`` with the generation prompt, but the completion has three sources:

1. **template split**: the template's rendering of ``messages[:k+1]`` starts with the prompt and
   holds the turn's reasoning; the completion is the rest (cut after the EOS where the template
   appends a generation prompt even to a finished conversation: :func:`turn_end`);
2. **derived format**: the template does not split this turn, but shows how it renders a *last* turn
   in this position (:mod:`onepass.render.derived`);
3. **given format**: ``--completion-format`` (:mod:`onepass.render.formats`), used alone when given.

A source gives a completion, or declines (with the error to report when no later source gives one:
the split's "reasoning not rendered" outranks the derived format's failure), or raises a
:class:`~onepass.render.errors.RenderError` that skips the turn at once. Then the source's checks run
(the reasoning rendered, every tool call rendered, not empty).

No torch here: this is pure data.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from onepass.conversation import Conversation, Message
from onepass.render.derived import derive_completion
from onepass.render.errors import ReasoningNotRendered, RenderError, UnopenedReasoning
from onepass.render.fields import TemplateFields
from onepass.render.formats import completion_fields, format_completion, unopened_close
from onepass.render.template import Render, prober, render_turn
from onepass.template_messages import template_messages


@dataclass(frozen=True, kw_only=True, slots=True)
class Turn:
    """Assistant message ``k`` of ``conv`` and how its template is called: what every source reads."""

    conv: Conversation
    k: int
    tokenizer: Any
    kwargs: Mapping[str, Any]
    fields: TemplateFields
    eos: str
    fmt: str | None = None  # the given completion format, resolved
    memo: dict[Any, Any] = field(default_factory=dict, compare=False)  # one per conversation (template._blame)

    @property
    def message(self) -> Message:
        return self.conv.messages[self.k]

    @property
    def at(self) -> str:
        return self.conv.at(self.k)

    def messages(self, upto: int) -> list[dict[str, Any]]:
        return template_messages(self.conv, upto, **self.fields.message_options)

    def render(self, upto: int, *, generation: bool) -> str:
        return render_turn(self.tokenizer, self.conv, self.messages(upto), generation=generation,
                           kwargs=self.kwargs, turn=self.k, blame=True, memo=self.memo)

    def prompt(self) -> str:
        return self.render(self.k, generation=True)

    def probe(self) -> Render:
        return prober(self.tokenizer, self.conv, self.kwargs, self.k)


@dataclass(frozen=True, slots=True)
class Declined:
    """A source that gives no completion for this turn; ``reason``: the error to report if none does."""

    reason: RenderError | None = None


def turn_end(completion: str, eos: str) -> str | None:
    """``completion`` cut after the turn's end-of-turn token ``eos`` (the tokenizer's EOS), or None when it
    is not in it. For a template that appends its generation prompt to a finished conversation too
    (Command R7B ``tool_use``: ``...<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>``):
    the next turn's header follows the turn, and the model, stopping at its EOS, never generates it.

    >>> turn_end("<a>x<eot><sot><bot>", "<eot>")
    '<a>x<eot>'
    """
    return completion[:completion.rindex(eos) + len(eos)] if eos and eos in completion else None


# --- the checks ------------------------------------------------------------------------------------

def reasoning_rendered(turn: Turn, completion: str) -> None:
    reasoning = (turn.message.reasoning or "").strip()
    if reasoning and reasoning not in completion:
        raise ReasoningNotRendered(
            f"{turn.at}: the chat template does not render this turn's reasoning "
            f"(looked for under {turn.fields.reasoning_key!r}), so it would never be trained. Train the turn "
            "without it as a non-thinking model generates it (--reasoning drop), use a thinking template, "
            "or pass a completion format (--completion-format think-tags if the model writes <think> tags)")


def tool_calls_rendered(turn: Turn, completion: str) -> None:
    calls = Counter(c.name for c in turn.message.tool_calls)
    missing = [name for name, n in calls.items() if completion.count(name) < n]
    if missing:
        raise RenderError(f"{turn.at}: the chat template does not render this turn's "
                          f"{calls[missing[0]]} tool call(s) {missing[0]!r} (found {completion.count(missing[0])}), "
                          "so they would never be trained")


def not_empty(turn: Turn, completion: str) -> None:
    if not completion:
        raise RenderError(f"{turn.at}: the completion is empty")


# --- the sources -----------------------------------------------------------------------------------

def template_split(turn: Turn, prompt: str) -> str | Declined:
    """The rest of the template's rendering of ``messages[:k+1]`` after the prompt, when it holds the reasoning."""
    full = turn.render(turn.k + 1, generation=False)
    if not full.startswith(prompt):
        return Declined()
    rest = full[len(prompt):]
    try:
        reasoning_rendered(turn, rest)
    except ReasoningNotRendered as e:  # the derived format may still hold it (quirks: final answer reasoning dropped)
        return Declined(e)
    end = turn_end(rest, turn.eos) if turn.fields.generation_always else rest
    if end is None:
        raise RenderError(f"{turn.at}: the chat template appends its generation prompt even to a finished "
                          f"conversation, and the tokenizer's EOS token ({turn.eos!r}) is not in this turn's "
                          "rendering, so where the turn ends cannot be read off")
    return end


def derived_format(turn: Turn, prompt: str) -> str | Declined:
    """The derived generation format filled with the turn (:func:`onepass.render.derived.derive_completion`)."""
    message, messages = turn.message, turn.messages(turn.k + 1)
    result = derive_completion(turn.probe(), messages[:-1], messages[-1], prompt,
                               reasoning_key=turn.fields.reasoning_key, reasoning=message.reasoning or "",
                               content=message.content, tool_names=[c.name for c in message.tool_calls])
    if result.text is None:
        return Declined(RenderError(
            f"{turn.at}: the chat template's rendering of the conversation up to this "
            "assistant turn does not start with its own generation prompt, and no generation format could "
            f"be derived from the template ({result.problem}): "
            + (result.hint or "see onepass templates check")))
    return result.text


def given_format(turn: Turn, prompt: str) -> str:
    """The completion from a ``--completion-format``, tool calls and end of turn as the template renders them."""
    fmt, message = turn.fmt, turn.message
    assert fmt is not None
    if message.tool_calls and "{tool_calls}" not in fmt:
        raise RenderError(f"{turn.at}: the completion format has no {{tool_calls}} "
                          "field, so this turn's tool calls would never be trained")
    messages = turn.messages(turn.k + 1)
    read = completion_fields(turn.probe(), messages[:-1], messages[-1], reasoning_key=turn.fields.reasoning_key)
    if read is None and message.tool_calls:
        raise RenderError(f"{turn.at}: the chat template does not show how it renders this "
                          "turn's tool calls, so the completion format cannot fill {tool_calls}")
    calls, end = read if read is not None else (None, turn.eos)
    if (closer := unopened_close(fmt, prompt)) is not None:
        raise UnopenedReasoning(
            f"{turn.at}: the completion format closes {closer} but this turn's generation prompt does not open "
            f"{closer.replace('/', '')} (it ends {prompt[-40:]!r}; DeepSeek-V3.1 after a tool result), so the target "
            "would close a tag the model never opened: skipped (think-tags opens it itself)")
    names = [c.name for c in message.tool_calls]
    missing = [n for n in names if (calls or "").count(n) < names.count(n)]
    if missing and read is not None:
        why = ("A template that renders tool calls only when the content is None (DeepSeek-R1-Distill) never does: "
               "transformers drops None-valued keys from every message before rendering, at inference too"
               if _mentions(turn.tokenizer, "tool_calls") else
               "This template never reads a message's tool_calls (it renders an assistant's content alone)")
        raise RenderError(f"{turn.at}: the chat template does not render this turn's tool call {missing[0]!r}, "
                          f"so the completion format cannot fill {{tool_calls}}. {why}; such a turn cannot be "
                          "trained with this template")
    return format_completion(fmt, message, end, calls)


def _mentions(tokenizer: Any, word: str) -> bool:
    """Does the chat template's text (any of its named templates) hold ``word``? Which explanation of a skip
    applies: a template that never reads ``tool_calls`` is not one that reads them only under a condition."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return any(word in text for text in (template.values() if isinstance(template, Mapping) else (template,)))


Check = Callable[[Turn, str], None]
Source = Callable[[Turn, str], "str | Declined"]


@dataclass(frozen=True, kw_only=True, slots=True)
class CompletionSource:
    """A source and the checks its completion must pass (a given format checks its tool calls itself)."""

    name: str
    complete: Source
    checks: tuple[Check, ...]
    flag: str | None = None  # the view.Provenance flag it sets ("derived": not the template's own split)


TEMPLATE_SOURCES = (
    CompletionSource(name="template split", complete=template_split,
                     checks=(reasoning_rendered, tool_calls_rendered, not_empty)),
    CompletionSource(name="derived format", complete=derived_format, flag="derived",
                     checks=(reasoning_rendered, tool_calls_rendered, not_empty)),
)
GIVEN_FORMAT = (CompletionSource(name="given format", complete=given_format, checks=(not_empty,)),)
