"""Reasoning left out of a view: an earlier message's that the template drops anyway, or the turn's own by choice.

Why this module exists: two kinds of view are well defined although the record's reasoning is not
in them, and each is counted on its own (never silently):

- **history** (automatic): gpt-oss raises ``Cannot pass both content and thinking`` for a tool-call
  turn holding both, so every later prompt holding that message raised too. Yet once a final answer
  follows, gptoss.jinja drops a tool call's analysis (``future_final_message``): in that position the
  template never shows that reasoning. Whether it does is *probed*, never assumed: the history is
  rendered with each earlier message's reasoning replaced by a sentinel of its own and its content
  removed (:func:`unrendered_history_reasoning`); a sentinel absent from both the prompt and the full
  rendering of the turn means the template drops that reasoning here, and the view is rendered from
  the history without it, the text the template renders for that position. A probe that raises or
  shows the sentinel keeps the skip.
- **own** (``--reasoning drop``, opt-in): a non-thinking template (Qwen3-Instruct-2507, DeepSeek-V3.1
  by default) never renders reasoning, so a turn with reasoning is skipped unless the user asks to
  train it as the non-thinking model generates it: content and tool calls, without the reasoning.

Worked example (gpt-oss, record with a tool call holding both content and reasoning, then an answer,
then a user turn and a second answer)::

    turn 8's history, message 1 probed   ...<|start|>assistant to=functions.get_weather...  (no sentinel)
    so the view renders message 1 as     {"content": "Checking both.", "tool_calls": [...]}
    which the template renders as        ...<|start|>assistant to=functions.get_weather...  (the same)

No torch here: this is pure data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from onepass.conversation.parse import Conversation
from onepass.render.template import Render
from onepass.render.messages import template_messages

REASONING_CHOICES = ("keep", "drop")
"""``--reasoning``: ``keep`` (default: a turn whose reasoning the template does not render is a counted
skip) or ``drop`` (train such a turn without its reasoning, as a non-thinking model generates it)."""

REASONING_HELP = ("keep (default): a turn whose reasoning the template never renders is skipped; drop: train it "
                  "without its reasoning, as a non-thinking model generates it (counted)")
"""The ``--reasoning`` help of every subcommand and config that takes it."""

SENTINEL = "ONEPASSxHISTORYxREASONINGx{}x"


def without_reasoning(conv: Conversation, turns: Iterable[int]) -> Conversation:
    """``conv`` with the reasoning of messages ``turns`` (indices into ``conv.messages``) removed."""
    drop = set(turns)
    return dataclasses.replace(conv, messages=tuple(
        dataclasses.replace(m, reasoning=None, text=None) if i in drop else m for i, m in enumerate(conv.messages)))


def unrendered_history_reasoning(render: Render, conv: Conversation, k: int, *, head: int,
                                 options: dict[str, Any]) -> list[int]:
    """Earlier assistant messages (indices into ``conv.messages``) whose reasoning the template renders
    neither in turn ``k``'s prompt nor in its full rendering; ``[]`` when a probe raises or none is dropped.

    ``head`` is the number of template messages before ``conv.messages[0]`` (the system prompt);
    ``options`` are the message fields the template expects (``reasoning_key`` among them).
    """
    candidates = [j for j, m in enumerate(conv.messages[:k]) if m.role == "assistant" and (m.reasoning or "").strip()]
    if not candidates:
        return []
    messages = template_messages(conv, k + 1, **options)
    for j in candidates:
        messages[head + j] = {**messages[head + j], options["reasoning_key"]: SENTINEL.format(j), "content": ""}
    prompt, full = render(messages[:head + k], True), render(messages, False)
    if prompt is None or full is None:
        return []
    return [j for j in candidates if SENTINEL.format(j) not in prompt and SENTINEL.format(j) not in full]
