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
    completion_k = full_k[len(prompt_k):]           if full_k starts with prompt_k  (template split)
                 = the derived generation format     else (onepass.render.derived)
                 = completion_format.format(...)     instead, if a format is given (onepass.render.formats)
                 (else: RenderError naming the turn and what failed: onepass.render.sources)
    tokens_k     = tokenize(prompt_k) + tokenize(completion_k)   (each on its own)

Tokenizing the two parts on their own is what happens at inference (the prompt is encoded, then the model
emits tokens); it differs from tokenizing ``full_k`` when a BPE merge crosses the boundary. Such views are
counted (``View.boundary_merge``, found on a window around the boundary: :func:`merges_across`). The prompts
of one conversation repeat its history: :mod:`onepass.render.encode` encodes each piece between added tokens once.

A turn that cannot be split, or for which the template raises, is skipped on its own (:func:`render_conversation`
returns it with its error, naming record, message and template line); the other views are kept. Message fields
go over as the template reads them (:mod:`onepass.render.fields`); reasoning is left out only by the
retries of :data:`RETRIES` (``--reasoning drop``, or an earlier turn's the template drops anyway:
:mod:`onepass.render.reasoning`), each counted on the view. No branch here names a model: which real
templates take which source, field or retry, and the test proving each, is the table
:data:`onepass.render.quirks.QUIRKS`.

Worked example (Qwen3, reasoning "r", answer "a")::

    prompt      <|im_start|>user\\nq<|im_end|>\\n<|im_start|>assistant\\n
    completion  <think>\\nr\\n</think>\\n\\na<|im_end|>\\n        <- trained tokens

No torch here: this is pure data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from onepass.conversation.parse import Conversation
from onepass.conversation.turns import TRAIN_TURNS, not_selected, selected_turns
from onepass.errors import UsageError
from onepass.render.clock import TEMPLATE_DATE
from onepass.render.encode import encode_texts, split_between
from onepass.render.errors import ReasoningNotRendered, RenderError, TemplateRaised
from onepass.render.fields import template_fields
from onepass.render.formats import resolve_completion_format
from onepass.render.preskip import Preskip
from onepass.render.reasoning import REASONING_CHOICES, unrendered_history_reasoning, without_reasoning
from onepass.render.sources import GIVEN_FORMAT, TEMPLATE_SOURCES, CompletionSource, Declined, Turn
from onepass.render.template import check_template_kwargs, prober, render_turn
from onepass.render.token_floor import token_floor
from onepass.render.messages import template_messages
from onepass.layout.view import Provenance, Unmeasured, View


@dataclass(frozen=True, kw_only=True)
class RenderConfig:
    """How to render views. ``template_kwargs`` go to the template (e.g. ``enable_thinking``); ``template_date``
    (``YYYY-MM-DD``) is the date a template that reads the clock renders (:mod:`onepass.render.clock`; None: the
    machine's clock, as transformers renders; ``DataConfig`` always gives one)."""

    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    completion_format: str | None = None  # a name from COMPLETION_FORMATS or a format string
    reasoning: str = "keep"  # or "drop": a turn whose reasoning the template never renders is trained without it
    template_date: str | None = None
    train_turns: str = "all"  # which assistant turns get a view: all, last, weight (onepass.conversation.turns)
    train_greeting: bool = False  # an assistant message opening the conversation (Conversation.greeting) gets a view

    def __post_init__(self) -> None:
        check_template_kwargs(self.template_kwargs)
        if self.reasoning not in REASONING_CHOICES:
            raise UsageError(f"--reasoning must be one of {', '.join(REASONING_CHOICES)}, got {self.reasoning!r}")
        if self.train_turns not in TRAIN_TURNS:
            raise UsageError(f"--train-turns must be one of {', '.join(TRAIN_TURNS)}, got {self.train_turns!r}")

    def kwargs(self) -> dict[str, Any]:
        """What every template call of a render takes: the template kwargs and the pinned date."""
        pinned = {TEMPLATE_DATE: self.template_date} if self.template_date is not None else {}
        return {**self.template_kwargs, **pinned}


@dataclass(frozen=True, slots=True)
class _Text:
    """One turn's texts, and how they were obtained (the View's provenance)."""

    prompt: str
    completion: str
    provenance: Provenance = Provenance()

    def flagged(self, flag: str | None) -> _Text:
        """These texts with the :class:`~onepass.layout.view.Provenance` flag ``flag`` set (None: as they are)."""
        if flag is None:
            return self
        return dataclasses.replace(self, provenance=dataclasses.replace(self.provenance, **{flag: True}))


def _complete(turn: Turn, sources: Sequence[CompletionSource]) -> _Text:
    """THE RULE for one turn: the prompt is the template's; the completion comes from the first source
    that gives one, and must pass that source's checks. When every source declines, the first reason
    given is the error (the template split's "reasoning not rendered" before the derived format's)."""
    prompt = turn.prompt()
    declined: list[Declined] = []
    for source in sources:
        completion = source.complete(turn, prompt)
        if isinstance(completion, Declined):
            declined.append(completion)
            continue
        for check in source.checks:
            check(turn, completion)
        return _Text(prompt, completion).flagged(source.flag)
    raise next(d.reason for d in declined if d.reason is not None)


@dataclass(frozen=True, kw_only=True, slots=True)
class Retry:
    """A second try of a turn skipped with error ``on``, with the reasoning of messages ``drop`` left out
    (no retry where it finds none), counted on the view as its :class:`~onepass.layout.view.Provenance` flag
    ``flag``. When the retry fails too, the error reported is the first one (``report_first``) or the retry's.

    Add a retry: a row of :data:`RETRIES`, and its flag a field of :class:`~onepass.layout.view.Provenance`."""

    name: str
    on: type[RenderError]
    drop: Callable[[Turn, RenderConfig], list[int]]
    flag: str
    report_first: bool


def _own_reasoning(turn: Turn, config: RenderConfig) -> list[int]:
    """``--reasoning drop``: the turn's own reasoning, which the template never renders (non-thinking)."""
    return [turn.k] if config.reasoning == "drop" else []


def _history_reasoning(turn: Turn, config: RenderConfig) -> list[int]:
    """Earlier messages the template raises for, in a position where it drops their reasoning anyway
    (gpt-oss): probed, never assumed (:func:`onepass.render.reasoning.unrendered_history_reasoning`)."""
    head = len(template_messages(turn.conv, 0))
    return unrendered_history_reasoning(turn.probe(), turn.conv, turn.k, head=head,
                                        options=turn.fields.message_options)


RETRIES = (
    Retry(name="own reasoning dropped", on=ReasoningNotRendered, drop=_own_reasoning, flag="reasoning_dropped",
          report_first=False),
    Retry(name="history reasoning dropped", on=TemplateRaised, drop=_history_reasoning,
          flag="history_reasoning_dropped", report_first=True),
)
"""The retries of a skipped turn, in order: at most one runs (the first whose ``on`` matches and finds reasoning)."""


def _turn_text(turn: Turn, config: RenderConfig, sources: Sequence[CompletionSource]) -> _Text:
    """The texts of one turn (:func:`_complete`), retried once per :data:`RETRIES`; or the RenderError."""
    try:
        return _complete(turn, sources)
    except RenderError as error:
        retry = next((r for r in RETRIES if isinstance(error, r.on)), None)
        dropped = retry.drop(turn, config) if retry is not None else []
        if retry is None or not dropped:
            raise
        try:
            text = _complete(dataclasses.replace(turn, conv=without_reasoning(turn.conv, dropped)), sources)
        except RenderError:
            if retry.report_first:
                raise error from None
            raise
        return text.flagged(retry.flag)


def trained_turns(conv: Conversation, config: RenderConfig) -> list[int]:
    """The assistant turns that get a view: those ``config.train_turns`` selects
    (:func:`onepass.conversation.turns.selected_turns`: never one the record marks not to train), but for the
    greeting that opens the conversation unless ``config.train_greeting`` (it answers no user turn)."""
    greeting = None if config.train_greeting else conv.greeting
    return [k for k in selected_turns(conv, config.train_turns) if k != greeting]


def _iter_texts(conv: Conversation, tokenizer: Any, config: RenderConfig, preskip: Preskip | None = None
                ) -> Iterator[tuple[int, _Text] | tuple[int, RenderError] | tuple[int, Unmeasured]]:
    """Per assistant turn: ``(turn, its texts)``, or ``(turn, the RenderError that skips it)``, or, with a
    ``preskip``, ``(turn, an unrendered Unmeasured)`` for a turn proven over its budget (not rendered)."""
    fmt = resolve_completion_format(config.completion_format)
    sources = GIVEN_FORMAT if fmt is not None else TEMPLATE_SOURCES
    kwargs = config.kwargs()
    eos = getattr(tokenizer, "eos_token", None) or ""
    memos: dict[int, dict[Any, Any]] = {}  # per tool list: the prefixes the template raised for, scanned once
    for k in trained_turns(conv, config):
        if preskip is not None and (over := preskip.skip(k)) is not None:
            yield k, over
            continue
        seen = conv.at_turn(k)  # with the tools turn k saw (a message's own list: Conversation.tools_at)
        fields = template_fields(tokenizer, kwargs, tools=bool(seen.tools))
        memo = memos.setdefault(id(seen.tools), {})  # template._blame: one memo per conversation and tool list
        turn = Turn(conv=seen, k=k, tokenizer=tokenizer, kwargs=kwargs, fields=fields, eos=eos, fmt=fmt, memo=memo)
        try:
            text = _turn_text(turn, config, sources)
        except RenderError as e:
            if preskip is not None:
                preskip.failed(k)
            yield k, e
            continue
        if preskip is not None and text.provenance.flags():
            preskip.failed(k)
        elif preskip is not None:
            preskip.saw(k, text.prompt, text.completion)
        yield k, text


def render_prompt(conv: Conversation, tokenizer: Any, upto: int,
                  template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The prompt the model sees before message ``upto``: ``messages[:upto]`` with the generation
    prompt, with the fields this template expects (:func:`onepass.render.fields.template_fields`),
    exactly as training renders a view's prompt. Inference-time callers (``onepass eval``) use it."""
    kwargs = dict(template_kwargs or {})
    conv = conv.at_turn(upto)  # the tools message ``upto`` is written with
    fields = template_fields(tokenizer, kwargs, tools=bool(conv.tools))
    return render_turn(tokenizer, conv, template_messages(conv, upto, **fields.message_options), generation=True,
                       kwargs=kwargs, turn=upto, blame=True)


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
    text, is compared with this in tests/render/test_render.py). Example: an R1 prompt ends ``<think>\\n`` and a
    completion with empty reasoning starts ``\\n</think>``; joined, ``\\n\\n`` is one Qwen token: True.
    A pair the tokenizer surely cuts at the boundary (an added token on either side:
    :func:`onepass.render.encode.split_between`) is False without encoding anything.
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

    views: tuple[View | Unmeasured, ...]  # Unmeasured only when asked for a max_tokens (render_conversation)
    skipped: tuple[RenderError, ...] = ()
    not_trained: int = 0  # assistant turns the record marks not to train (weight 0): no view, context only
    not_selected: int = 0  # assistant turns --train-turns leaves as context (last, weight): no view
    arguments_parsed: int = 0  # tool calls given as a JSON string, parsed for a template that needs a dict
    inline_reasoning: int = 0  # messages whose <think> block stays in the content: the template reads no reasoning field
    greeting_not_trained: int = 0  # an assistant message opening the conversation, left untrained (no --train-greeting)
    texts: tuple[tuple[int, str, str], ...] = ()  # (turn, prompt, completion) of each turn rendered, when asked
    # (keep_texts): what onepass.render.single compares the single rendering with


def _counts(conv: Conversation, tokenizer: Any, config: RenderConfig) -> dict[str, int]:
    """:class:`Rendered`'s counts of what the record says and the template needs, beside the views."""
    fields = template_fields(tokenizer, config.kwargs(), tools=bool(conv.tools or conv.tool_changes))
    strings = sum(c.text is not None for m in conv.messages for c in m.tool_calls)
    greeting = conv.greeting
    return {"not_trained": sum(m.role == "assistant" and not m.train for m in conv.messages),
            "greeting_not_trained": int(greeting is not None and not config.train_greeting
                                        and greeting in selected_turns(conv, config.train_turns)),
            "not_selected": not_selected(conv, config.train_turns),
            "arguments_parsed": 0 if fields.string_arguments else strings,
            "inline_reasoning": 0 if fields.reads_reasoning else sum(m.text is not None for m in conv.messages)}


def _unmeasured(conv: Conversation, tokenizer: Any, turn: int, text: _Text, max_tokens: int | None
                ) -> Unmeasured | None:
    """The turn as an :class:`Unmeasured` view when its token floor is already over ``max_tokens``
    (both parts non-empty, so it could not be skipped for an empty prompt or completion instead)."""
    if max_tokens is None:
        return None
    floors = (token_floor(tokenizer, text.prompt), token_floor(tokenizer, text.completion))
    if min(floors) < 1 or sum(floors) <= max_tokens:
        return None
    return Unmeasured(turn=turn, at_least=sum(floors), chars=len(text.prompt) + len(text.completion),
                      source=conv.source, provenance=text.provenance, first_message=conv.first_message)


def _preskip(conv: Conversation, tokenizer: Any, config: RenderConfig, max_tokens: int | None) -> Preskip | None:
    """The conversation's :class:`~onepass.render.preskip.Preskip` under ``max_tokens`` (None: no budget, or
    no turn after the first, which it could skip)."""
    turns = trained_turns(conv, config)
    if max_tokens is None or len(turns) < 2:
        return None
    kwargs = config.kwargs()

    def render_prompt(k: int) -> str | None:
        seen = conv.at_turn(k)
        fields = template_fields(tokenizer, kwargs, tools=bool(seen.tools))
        return prober(tokenizer, seen, kwargs, k)(template_messages(seen, k, **fields.message_options), True)

    return Preskip(conv, tokenizer, max_tokens, last_turn=turns[-1], render_prompt=render_prompt)


def render_conversation(conv: Conversation, tokenizer: Any, config: RenderConfig = RenderConfig(), *,
                        max_tokens: int | None = None, keep_texts: bool = False) -> Rendered:
    """Every view of ``conv`` that renders; a turn that does not is skipped on its own, with its
    error, and the conversation's other views are kept (a view depends on its own turn only).
    With ``max_tokens``, a view whose token floor is over it is not tokenized: it comes back as an
    :class:`~onepass.layout.view.Unmeasured` in its place (:mod:`onepass.render.token_floor`); a view proven over
    it from the messages it must hold is not even rendered (:mod:`onepass.render.preskip`). ``keep_texts``: the
    texts of each turn rendered come back too (:attr:`Rendered.texts`)."""
    texts: list[tuple[int, _Text]] = []
    skipped: list[tuple[int, RenderError]] = []
    unmeasured: dict[int, Unmeasured] = {}
    for item in _iter_texts(conv, tokenizer, config, _preskip(conv, tokenizer, config, max_tokens)):
        if isinstance(item[1], Unmeasured):
            unmeasured[item[0]] = item[1]
        elif isinstance(item[1], RenderError):
            skipped.append(item)  # type: ignore[arg-type]
        elif (over := _unmeasured(conv, tokenizer, item[0], item[1], max_tokens)) is not None:
            unmeasured[item[0]] = over
        else:
            texts.append(item)  # type: ignore[arg-type]
    counts: dict[str, Any] = _counts(conv, tokenizer, config)
    if keep_texts:
        counts["texts"] = tuple((turn, t.prompt, t.completion) for turn, t in texts)
    if not texts:
        return Rendered(views=tuple(unmeasured.values()), skipped=tuple(e for _, e in skipped), **counts)
    encoded = encode_texts(tokenizer, [t.prompt for _, t in texts] + [t.completion for _, t in texts])
    prompts, completions = encoded[:len(texts)], encoded[len(texts):]
    merged = merges_across(tokenizer, [(t.prompt, t.completion) for _, t in texts])
    views: list[View | Unmeasured] = []
    for (turn, text), p, c, merge in zip(texts, prompts, completions, merged):
        if not c:
            skipped.append((turn, RenderError(f"{conv.at(turn)}: the completion has no tokens")))
        elif not p:
            skipped.append((turn, RenderError(f"{conv.at(turn)}: the prompt has no tokens, so "
                                              "the first completion token has nothing to be predicted from")))
        else:
            views.append(View(tokens=np.asarray(p + c, dtype=np.int64), num_prompt=len(p), turn=turn,
                              source=conv.source, boundary_merge=merge, provenance=text.provenance,
                              first_message=conv.first_message))
    skipped.sort(key=lambda pair: pair[0])
    views = sorted([*views, *unmeasured.values()], key=lambda v: v.turn)
    return Rendered(views=tuple(views), skipped=tuple(e for _, e in skipped), **counts)


def render_views(conv: Conversation, tokenizer: Any, config: RenderConfig = RenderConfig()
                 ) -> list[View]:
    """The N-pass views of ``conv``, in turn order; raises the first skipped turn's RenderError."""
    rendered = render_conversation(conv, tokenizer, config)
    if rendered.skipped:
        raise rendered.skipped[0]
    return [v for v in rendered.views if isinstance(v, View)]  # all of them: no max_tokens, no Unmeasured
