"""Template calls per turn are bounded: a long conversation costs a fixed number of renders per turn
(issue 37, round 3: "rendering is quadratic in the number of turns").

Before: a turn skipped because the template raises named the message it raises for by rendering every
prefix of the conversation again (1, 2, ... k messages), for every such turn: k template calls for turn k,
so a conversation of n turns cost ~n^2/2 calls (and ~n^3 messages rendered), the retry of gpt-oss's
history reasoning on real agent data included. Now each prefix's outcome is kept by its content for the
conversation (``onepass.render.template._blame``): a turn adds a fixed number of calls.

What stays: every view's prompt is the template's own rendering of ``messages[:k]``, a text that grows
with k, so the messages handed to the template grow as the N-pass text does (the sum of the views'
lengths, quadratic in the turns of one conversation); benchmarks/render_scaling.py measures it.
"""

from __future__ import annotations

import onepass.render.template as template_module
from onepass.conversation.parse import parse_record
from onepass.render import render_conversation

# Raises once the conversation is longer than 6 messages, naming its length (as templates that say "message
# at index N ..." do): a prefix raises another text than the turn's prompt, so the scan for the culprit ran on.
LONG = ("{% if messages|length > 6 %}{{ raise_exception('too long: ' ~ (messages|length)) }}{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _conversation(turns: int):
    msgs = []
    for i in range(turns):
        msgs += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    return parse_record({"messages": msgs})


def _calls(monkeypatch, tok, turns: int) -> tuple[int, int]:
    calls = []
    real = template_module.apply_template
    monkeypatch.setattr(template_module, "apply_template", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    rendered = render_conversation(_conversation(turns), tok)
    assert len(rendered.views) == 3 and len(rendered.skipped) == turns - 3
    return len(calls), len(rendered.skipped)


def test_template_calls_grow_linearly_with_the_turns(with_template, monkeypatch, turns=40):
    tok = with_template(LONG)
    render_conversation(_conversation(1), tok)  # the template's fields are probed once, outside the count
    small, skipped_small = _calls(monkeypatch, tok, turns)
    monkeypatch.undo()
    big, skipped_big = _calls(monkeypatch, tok, 4 * turns)
    # 4x the turns: 4x the calls (now 122 -> 482), not 16x (before: 1,634 -> 25,754)
    assert big / small < 4 * 1.5, (small, big)
    assert big <= 6 * 4 * turns, big
