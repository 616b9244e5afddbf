"""The turn-by-turn evaluation loop: every assistant turn generated as at inference, then scored.

Why this module exists: a fine-tuned reasoning model is used one turn at a
time. At assistant turn k it sees the model's own chat template applied to
``messages[:k]`` with the generation prompt (exactly the prompt onepass trains
turn k on, :func:`onepass.render.render_texts`), where the template drops the
reasoning of earlier turns. Whether it got better at *multi-turn* reasoning is
its accuracy at turns 2, 3, ... in that context. Two kinds of history:

- ``reference``: earlier assistant turns are the dataset's (teacher forcing).
  Turn k measures turn k alone; every turn's prompt is known up front.
- ``model``: earlier assistant turns are the model's own replies, its reasoning
  split off into ``reasoning_content`` so the template treats it as reasoning
  (and drops it from later prompts, as at inference). Errors compound, as in use.

Turn k of every conversation is generated in one call (a batch across
conversations), then turn k+1. The reference answer of a turn is extracted from
the dataset's assistant *content* (:mod:`onepass.evaluate.answers`); a turn
whose reference has none (MathChat's deliberately wrong first answers in
``error_correction`` say "So, she must make $20") is not scored, and counted.

Example with a scripted generator (``reference`` history)::

    >>> from onepass.conversation.parse import parse_record
    >>> conv = parse_record({"messages": [
    ...     {"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "The answer is 2."},
    ...     {"role": "user", "content": "times 3?"}, {"role": "assistant", "content": "The answer is 6."}]})
    >>> class Fake:
    ...     def generate(self, prompts): return ["<think>easy</think>The answer is 2."] * len(prompts)
    >>> prompt = lambda c, k: " | ".join(m["content"] for m in template_messages(c, k))
    >>> [(r.turn, r.reasoning, r.predicted, r.reference, r.correct) for r in evaluate([conv], Fake(), prompt)]
    [(1, 'easy', '2', '2', True), (2, 'easy', '2', '6', False)]

No torch here: the generator holds the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from onepass.conversation.parse import Conversation, Message, split_inline_reasoning
from onepass.errors import UsageError
from onepass.evaluate.answers import answers_match, compile_answer_regex, extract_answer
from onepass.evaluate.generate import Generator, MessagesGenerator
from onepass.render import render_prompt
from onepass.render.fields import template_fields
from onepass.render.messages import template_messages

HISTORY_MODES = ("reference", "model")

NO_ANSWER = "no final answer in the reply"
UNFINISHED = "the reply's reasoning never closes (</think> missing): raise --max-new-tokens"
NO_REFERENCE = "the dataset's answer has no final answer to compare with"

PromptFn = Callable[[Conversation, int], str]
"""``prompt(conversation, k)``: the text the model sees before assistant message ``k``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TurnResult:
    """One generated assistant turn and its score. ``correct`` is None when the turn is not scored."""

    conversation: int  # index in the evaluated list
    id: str | None
    source: str
    depth: int  # assistant turns in the conversation
    turn: int  # 1-based assistant turn
    message: int  # index in Conversation.messages
    reply: str
    reasoning: str | None
    predicted: str | None
    reference: str | None
    correct: bool | None
    note: str | None = None  # why there is no prediction, or why the turn is not scored

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def template_prompt(tokenizer: Any, template_kwargs: Mapping[str, Any] | None = None) -> PromptFn:
    """The prompt function of a tokenizer's chat template: ``messages[:k]`` with the generation prompt,
    rendered by :func:`onepass.render.render_prompt`, as training renders prompts (system, tools,
    kwargs, the fields the template expects)."""
    kwargs = dict(template_kwargs or {})
    return lambda conv, k: render_prompt(conv, tokenizer, k, kwargs)


def template_message_options(tokenizer: Any, template_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The message fields the tokenizer's template expects (:func:`onepass.render.fields.template_fields`:
    tool-call arguments, reasoning key, developer role, tool-call ids), as training and
    :func:`template_prompt` hand messages over; for :func:`evaluate`'s messages path."""
    return template_fields(tokenizer, dict(template_kwargs or {})).message_options


def split_reply(reply: str) -> tuple[str | None, str, bool]:
    """``(reasoning, content, finished)`` of a generated reply.

    ``<think>r</think>c`` -> (r, c); a reply that opens ``<think>`` and never closes it is all
    reasoning and unfinished (what a reasoning parser does with a cut-off generation).
    """
    reasoning, content = split_inline_reasoning(reply)
    if reasoning is None and "<think>" in reply:
        return reply.split("<think>", 1)[1].strip("\n"), "", False
    return reasoning, content.strip(), True


def _score(conv_index: int, conv: Conversation, turn: int, k: int, reply: str,
           regex: Any) -> tuple[TurnResult, Message]:
    reasoning, content, finished = split_reply(reply)
    predicted = extract_answer(content, regex) if finished else None
    reference = extract_answer(conv.messages[k].content, regex)
    note = None
    if reference is None:
        note = NO_REFERENCE
    elif predicted is None:
        note = NO_ANSWER if finished else UNFINISHED
    result = TurnResult(
        conversation=conv_index, id=conv.id, source=conv.source, depth=conv.num_assistant_turns, turn=turn,
        message=k, reply=reply, reasoning=reasoning, predicted=predicted, reference=reference,
        correct=None if reference is None else answers_match(predicted, reference), note=note)
    return result, Message(role="assistant", content=content, reasoning=reasoning)


def evaluate(conversations: Sequence[Conversation], generator: Generator | MessagesGenerator, prompt: PromptFn,
             *, history: str = "reference", answer_regex: str | None = None,
             progress: bool = False, message_options: Mapping[str, Any] | None = None) -> list[TurnResult]:
    """Generate and score every assistant turn of every conversation; results in (turn, conversation) order.

    ``prompt`` renders a conversation up to message k (:func:`template_prompt`); a
    :class:`~onepass.evaluate.generate.MessagesGenerator` gets the messages instead, with the fields
    the template expects (``message_options``: :func:`template_message_options`, as render hands them over).
    """
    options = dict(message_options or {})
    if history not in HISTORY_MODES:
        raise UsageError(f"history must be one of {', '.join(HISTORY_MODES)}, got {history!r}")
    regex = compile_answer_regex(answer_regex)
    # The conversations as they stand for the next turn: in "model" mode their earlier
    # assistant messages are replaced by the model's replies as they come.
    live = list(conversations)
    positions = [[k for k, m in enumerate(c.messages) if m.role == "assistant"] for c in conversations]
    results: list[TurnResult] = []
    depth = max((len(p) for p in positions), default=0)
    from tqdm.auto import tqdm

    for t in tqdm(range(depth), desc="turns", unit="turn", disable=not progress):
        todo = [(i, positions[i][t]) for i in range(len(live)) if t < len(positions[i])]
        if isinstance(generator, MessagesGenerator):
            replies = generator.generate_messages([template_messages(live[i], k, **options) for i, k in todo])
        else:
            replies = generator.generate([prompt(live[i], k) for i, k in todo])
        if len(replies) != len(todo):
            raise RuntimeError(f"the generator returned {len(replies)} replies for {len(todo)} prompts")
        for (i, k), reply in zip(todo, replies):
            result, message = _score(i, conversations[i], t + 1, k, reply, regex)
            results.append(result)
            if history == "model":
                messages = list(live[i].messages)
                messages[k] = dataclasses.replace(message, tool_calls=messages[k].tool_calls)
                live[i] = dataclasses.replace(live[i], messages=tuple(messages))
    return results
