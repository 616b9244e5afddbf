"""The derived generation format: what the model generates at a turn its template cannot split.

Why this module exists: a view is ``prompt_k + completion_k`` with ``prompt_k`` the template's
rendering of ``messages[:k]`` with the generation prompt. Usually the template's rendering of
``messages[:k+1]`` starts with ``prompt_k`` and the completion is the rest (:mod:`onepass.render.sources`). Some
templates break that prefix for one turn although the view is well defined:

- Nemotron 3, MiniMax-M2: the generation prompt opens ``<think>\\n``, but a turn with *empty*
  reasoning is rendered ``<think></think>answer``;
- gpt-oss: once a final answer follows, the analysis of an earlier tool-call turn is dropped from
  the history, so the history differs from the one in the prompt;
- Kimi-K2-Thinking: a final answer is rendered ``<think></think>answer`` (its reasoning dropped,
  even as the last turn) while a tool-call turn after it keeps ``<think>R</think>``.

The template still says how it renders a *last* assistant turn in this position: render the
conversation up to turn k with a probe turn whose reasoning (and content) are sentinel strings,
read off the text the template puts after the generation prompt, and put the turn's real
reasoning and content where the sentinels are. Tool calls, end-of-turn tokens and every byte in
between come from the template itself::

    prompt      ...<|im_start|>assistant\\n<think>\\n            (Nemotron 3, the real prompt)
    probe       ...<|im_start|>assistant\\n<think>\\nREASONING\\n</think>\\nCONTENT<|im_end|>\\n
    read off    REASONING\\n</think>\\nCONTENT<|im_end|>\\n
    turn        reasoning "", content "Hi."
    completion  \\n</think>\\nHi.<|im_end|>\\n

Where the template drops the probe's reasoning but renders it on a tool-call turn in the same
position (Kimi-K2), the reasoning block is read off that tool-call turn (``<think>R</think>``) and
put where the answer holds the same block emptied (``<think></think>``): :func:`_reasoning_block`.

Where the format cannot be read off (a sentinel missing or found twice, the generation prompt not
found in the probe, the template raising), :func:`derive_completion` says why and the turn stays
a counted skip. :func:`onepass.render.formats.completion_fields` reads the same way what a
``--completion-format`` puts in ``{tool_calls}`` and ``{eos}``.

No torch here: this is pure data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from onepass.render.template import Render

REASONING = "ONEPASSxREASONINGxSENTINEL"
CONTENT = "ONEPASSxCONTENTxSENTINEL"



@dataclass(frozen=True, kw_only=True, slots=True)
class Derived:
    """A derived completion (``text``), or why none could be derived (``problem``, ``hint``)."""

    text: str | None = None
    problem: str = ""
    hint: str = ""


def _opener_hint(prompt: str, history: str | None, rendered: str) -> str:
    """Why the generation prompt was not found: an R1-style prompt opens a block (``<think>\\n``)
    that the template never renders for a finished turn; the model's format is then not in it."""
    if history is None or not prompt.startswith(history) or not rendered.startswith(history):
        return "the template renders the history differently once this turn follows"
    gen, turn = prompt[len(history):], rendered[len(history):]
    common = 0
    while common < min(len(gen), len(turn)) and gen[common] == turn[common]:
        common += 1
    opened = gen[common:]
    if opened.strip().startswith("<"):
        return (f"the generation prompt opens {opened!r}, which the template never renders for a finished "
                "turn (DeepSeek-R1 style), so how the model closes it cannot be read from the template: "
                "pass --completion-format deepseek-r1")
    return f"the template renders this turn without the end of its generation prompt ({opened!r})"


def read_completion(prompt: str, history: str | None, rendered: str, *, anchors: Sequence[str],
                    history_texts: Sequence[str] = ()) -> str | Derived:
    """The text after the generation prompt in ``rendered`` (a probe turn rendered last), or why not.

    ``history`` is ``messages[:k]`` rendered without the generation prompt; ``anchors`` are texts
    that only the probe turn holds (sentinels, tool names): the generation prompt is looked for
    last before the first of them, so a history rendered differently (gpt-oss) does not matter;
    an earlier message's text (``history_texts``) between the two means it was found in the history.

    >>> read_completion("<u>q<a>", "<u>q", "<u>q<a>Rx<e>", anchors=["Rx"])
    'Rx<e>'
    >>> read_completion("<u>q<a>", "<u>q", "<u>Q<a>Rx<e>", anchors=["Rx"])  # history re-rendered
    'Rx<e>'
    """
    if rendered.startswith(prompt):
        return rendered[len(prompt):]
    found = [i for i in (rendered.find(a) for a in anchors if a) if i >= 0]
    if history is None or not prompt.startswith(history) or not found:
        return Derived(problem="the probe turn is not found after the generation prompt",
                       hint=_opener_hint(prompt, history, rendered))
    gen, first = prompt[len(history):], min(found)
    start = rendered.rfind(gen, 0, first) if gen else -1
    if start < 0:
        return Derived(problem="the generation prompt is not found before the probe turn",
                       hint=_opener_hint(prompt, history, rendered))
    between = rendered[start + len(gen):first]
    if any(len(t.strip()) >= 4 and t.strip() in between for t in history_texts):
        return Derived(problem="the generation prompt found before the probe turn belongs to an earlier "
                               "message", hint=_opener_hint(prompt, history, rendered))
    return rendered[start + len(gen):]


def fill(text: str, *, reasoning: str, content: str | None) -> str:
    """Put the turn's reasoning (and content, when it was probed) where the sentinels are."""
    text = text.replace(REASONING, reasoning)
    return text if content is None else text.replace(CONTENT, content)


def probe_turn(turn: dict[str, Any], reasoning_key: str, *, content: bool) -> dict[str, Any]:
    probe = dict(turn)
    probe[reasoning_key] = REASONING
    if content:
        probe["content"] = CONTENT
    return probe


def derive_completion(render: Render, history: list[dict[str, Any]], turn: dict[str, Any], prompt: str, *,
                      reasoning_key: str, reasoning: str, content: str,
                      tool_names: Sequence[str] = ()) -> Derived:
    """The completion of ``turn`` (a template dict, rendered last after ``history``) after ``prompt``.

    The probe replaces the reasoning by a sentinel always (empty reasoning is what Nemotron renders
    differently) and the content only when it is not empty (an empty content can change the
    template's branch). The derived text must hold the reasoning sentinel exactly once when the
    turn has reasoning, the content sentinel exactly once, and every tool call's name.
    """
    probe_content = bool(content.strip())
    rendered = render(history + [probe_turn(turn, reasoning_key, content=probe_content)], False)
    if rendered is None:
        return Derived(problem="the template raised rendering a probe of this turn")
    texts = [m["content"] for m in history if isinstance(m.get("content"), str)]
    text = read_completion(prompt, render(history, False), rendered, history_texts=texts,
                           anchors=[REASONING, CONTENT if probe_content else ""])
    if isinstance(text, Derived):
        return text
    if reasoning.strip() and REASONING not in text:
        text = _reasoning_block(render, history, turn, prompt, text, reasoning_key=reasoning_key) or text
    if text.count(REASONING) > 1 or (reasoning.strip() and text.count(REASONING) != 1):
        return Derived(problem=f"the template renders a probe reasoning {text.count(REASONING)} times in this "
                               "position", hint="the template does not render reasoning on this turn")
    if probe_content and text.count(CONTENT) != 1:
        return Derived(problem=f"the template renders a probe content {text.count(CONTENT)} times")
    missing = [name for name in tool_names if name not in text]
    if missing:
        return Derived(problem=f"the template does not render the tool call {missing[0]!r} in this position")
    return Derived(text=fill(text, reasoning=reasoning, content=content if probe_content else None))


def _reasoning_block(render: Render, history: list[dict[str, Any]], turn: dict[str, Any], prompt: str,
                     text: str, *, reasoning_key: str) -> str | None:
    """``text`` (a last turn whose reasoning the template dropped) with the reasoning block the template
    renders on a probe *tool-call* turn in this position, or None when the two do not agree.

    Kimi-K2-Thinking::

        text (answer)            <think></think>CONTENT<|im_end|>
        probe tool-call turn     <think>REASONING</think>CONTENT<|tool_calls_section_begin|>...
        block, block emptied     <think>REASONING</think>, <think></think>
        result                   <think>REASONING</think>CONTENT<|im_end|>

    The answer must open with the emptied block exactly: the template then shows both where the
    reasoning goes and that it is the same block (an R1-style or non-thinking template never does).
    """
    call = {"type": "function", "id": "functions.onepass_probe:0", "function": {"name": "onepass_probe"}}
    history_text = render(history, False)

    def block(reasoning: str) -> str | None:
        for arguments in ({}, "{}"):  # a dict, or a JSON string for templates that concatenate it
            probe = {**turn, reasoning_key: reasoning, "content": CONTENT,
                     "tool_calls": [{**call, "function": {**call["function"], "arguments": arguments}}]}
            rendered = render(history + [probe], False)
            if rendered is not None:
                got = read_completion(prompt, history_text, rendered, anchors=[CONTENT])
                return None if isinstance(got, Derived) or got.count(CONTENT) != 1 else got.split(CONTENT)[0]
        return None

    full, empty = block(REASONING), block("")
    if not full or not empty or full.count(REASONING) != 1 or full.replace(REASONING, "") != empty:
        return None
    return full + text[len(empty):] if text.startswith(empty) else None
