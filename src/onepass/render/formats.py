"""Completion formats: a turn's completion written from a format string (``--completion-format``).

Why this module exists: an R1-style template never renders a finished turn's reasoning, so the
model's own format cannot be read from it; the user names it instead (``deepseek-r1``,
``think-tags`` or a format string with ``{reasoning} {content} {tool_calls} {eos}``). Only the parts
the model writes around the fields come from the format: the turn's tool calls and end of turn are
read off the template in this position (:func:`completion_fields`), so they are the template's bytes.

    >>> from onepass.conversation.parse import Message
    >>> format_completion(COMPLETION_FORMATS["deepseek-r1"], Message(role="assistant", content="4",
    ...                   reasoning="2+2"), "<eos>")
    '2+2\\n</think>\\n\\n4<eos>'

No torch here: this is pure data.
"""

from __future__ import annotations

import json
from typing import Any

from onepass.conversation.parse import Message
from onepass.render.derived import CONTENT, REASONING, probe_turn
from onepass.render.errors import RenderError
from onepass.render.template import Render

COMPLETION_FORMATS: dict[str, str] = {
    # DeepSeek-R1 style templates strip reasoning from every assistant turn and end
    # the generation prompt with "<think>\n": the model generates the rest.
    "deepseek-r1": "{reasoning}\n</think>\n\n{content}{tool_calls}{eos}",
    # A template whose generation prompt ends with the assistant header only.
    "think-tags": "<think>\n{reasoning}\n</think>\n\n{content}{tool_calls}{eos}",
}
"""Named completion formats. Fields: ``{reasoning}`` (empty string when absent),
``{content}``, ``{tool_calls}`` and ``{eos}``: the turn's tool calls and the end of
the turn as the template renders them after the content
(:func:`completion_fields`; where the template does not
show them, Qwen-style ``<tool_call>`` blocks and the tokenizer's EOS token). Any
other string with these fields is accepted as a format too; one without
``{tool_calls}`` skips (and counts) a turn with tool calls, never drops them."""


def resolve_completion_format(spec: str | None) -> str | None:
    """The format string of a name in :data:`COMPLETION_FORMATS` or a format string, checked; None stays None."""
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


def completion_fields(render: Render, history: list[dict[str, Any]], turn: dict[str, Any], *,
                      reasoning_key: str) -> tuple[str, str] | None:
    """``({tool_calls}, {eos})`` of a completion format, as the template renders them for ``turn`` in
    this position: the text after the content (the turn's tool calls, then the end of the turn).
    None when the template does not render a probe content once (then the format cannot be filled).

    Example (Qwen3, a tool-call turn): ``('\\n<tool_call>\\n{"name": ...}\\n</tool_call>', '<|im_end|>\\n')``.
    """
    def tail(message: dict[str, Any]) -> str | None:
        text = render(history + [probe_turn(message, reasoning_key, content=True)], False)
        if text is None or text.count(CONTENT) != 1 or REASONING in text.split(CONTENT)[1]:
            return None
        head, after = text.split(CONTENT)
        if not (message.get("content") or "").strip():  # what follows an empty content (QwQ: no "\n")
            empty = render(history + [probe_turn(message, reasoning_key, content=False)], False)
            if empty is not None and empty.startswith(head):
                return empty[len(head):]
        return after

    with_calls = tail(turn)
    if with_calls is None:
        return None
    if not turn.get("tool_calls"):
        return "", with_calls
    without = tail({k: v for k, v in turn.items() if k != "tool_calls"})
    if without and with_calls.endswith(without):
        return with_calls[:-len(without)], without
    return with_calls, ""


def format_completion(fmt: str, message: Message, eos: str, tool_calls: str | None = None) -> str:
    """``fmt`` filled with the turn's fields; ``tool_calls`` is the template's own text for them
    (:func:`completion_fields`), else Qwen-style ``<tool_call>`` blocks."""
    calls = tool_calls if tool_calls is not None else "".join(
        "\n<tool_call>\n" + json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False)
        + "\n</tool_call>" for c in message.tool_calls)
    return fmt.format(reasoning=message.reasoning or "", content=message.content,
                      tool_calls=calls, eos=eos)


def unopened_close(fmt: str, prompt: str, tag: str = "think") -> str | None:
    """The closing ``</tag>`` a completion format writes before opening it, where the generation prompt
    ``prompt`` has no open ``<tag>`` either (DeepSeek-V3.1 thinking after a tool result); else None.

    >>> unopened_close("{reasoning}\\n</think>\\n\\n{content}", "<｜tool▁output▁end｜>")
    '</think>'
    >>> unopened_close("{reasoning}\\n</think>\\n\\n{content}", "<｜Assistant｜><think>") is None
    True
    """
    opener, closer = f"<{tag}>", f"</{tag}>"
    head = fmt.format(reasoning="", content="", tool_calls="", eos="")
    closes = head.find(closer)
    if closes < 0 or opener in head[:closes] or prompt.rfind(opener) > prompt.rfind(closer):
        return None
    return closer
