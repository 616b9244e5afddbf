"""Template calls per turn are bounded: a long conversation costs a fixed number of renders per turn
(issue 37, round 3: "rendering is quadratic in the number of turns").

Before: a turn skipped because the template raises named the message it raises for by rendering every
prefix of the conversation again (1, 2, ... k messages), for every such turn: k template calls for turn k,
so a conversation of n turns cost ~n^2/2 calls (and ~n^3 messages rendered), the retry of gpt-oss's
history reasoning on real agent data included. Now each prefix's outcome is kept by its content for the
conversation (``onepass.render.template._blame``): a turn adds a fixed number of calls.

With ``--max-tokens``, a view proven over it from the messages it must hold is not rendered at all
(``onepass.render.preskip``): the budgeted render of a long conversation hands the template text linear in
its turns (the last test). What stays without a budget: every view's prompt is the template's own rendering
of ``messages[:k]``, a text that grows with k, so the messages handed to the template grow as the N-pass text
does (the sum of the views' lengths, quadratic in the turns of one conversation); benchmarks/render_scaling.py
measures both.
"""

from __future__ import annotations

import onepass.render.template as template_module
from onepass.conversation.parse import parse_record
from onepass.render import render_conversation
from onepass.layout.view import View

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


def _qa(turns: int):
    """Questions and answers with reasoning, as benchmarks/render_scaling.py's conversations."""
    msgs = []
    for i in range(turns):
        msgs += [{"role": "user", "content": f"Question {i}: what is {i} plus {i + 1}?"},
                 {"role": "assistant", "content": f"It is {2 * i + 1}.", "reasoning_content": f"Add {i} and {i + 1}."}]
    return parse_record({"messages": msgs})


def _handed(monkeypatch, tok, turns: int, max_tokens: int) -> tuple[int, int, int]:
    """(messages handed to the template, characters it returned, views over max_tokens) rendering ``turns``."""
    messages, chars = [], []
    real = template_module.apply_template

    def counting(tokenizer, msgs, **kw):
        out = real(tokenizer, msgs, **kw)
        messages.append(len(msgs))
        chars.append(len(out) if isinstance(out, str) else 0)
        return out

    monkeypatch.setattr(template_module, "apply_template", counting)
    rendered = render_conversation(_qa(turns), tok, max_tokens=max_tokens)
    monkeypatch.undo()
    over = sum(not isinstance(v, View) or len(v) > max_tokens for v in rendered.views)
    return sum(messages), sum(chars), over


def test_a_budgeted_conversation_hands_the_template_text_linear_in_its_turns(qwen3_tokenizer, monkeypatch,
                                                                             turns=100):
    """With --max-tokens, a view whose messages alone are over it is skipped without rendering it
    (onepass.render.preskip): 4x the turns hand the template at most ~4x the messages and get at most ~4x the
    text back (now 409 -> 1,009 messages, 21k -> 53k characters: the views rendered before the budget is
    proven cost the same, then one prompt of every message; 1,189 -> 1,789 before the history floor of issue 44). Before, every view was rendered to learn its
    length, the N-pass text: 16x (20,100 -> 320,400 messages, 1.0 MB -> 16.7 MB of text)."""
    render_conversation(_qa(1), qwen3_tokenizer)  # the template's fields are probed once, outside the count
    small_messages, small_chars, small_over = _handed(monkeypatch, qwen3_tokenizer, turns, 256)
    big_messages, big_chars, big_over = _handed(monkeypatch, qwen3_tokenizer, 4 * turns, 256)
    assert small_over > turns // 2 and big_over > 4 * turns - turns // 2  # most views are over the budget
    assert big_messages / small_messages < 4 * 1.5, (small_messages, big_messages)
    assert big_chars / small_chars < 4 * 1.5, (small_chars, big_chars)


class _TooManyMessages(Exception):
    pass


def test_short_messages_under_a_row_budget_render_about_the_views_that_fit(qwen3_tokenizer, monkeypatch,
                                                                           turns=500, max_tokens=512):
    """Issue 44, item 15: 8,000 short messages with a row budget took 266 s to prepare (2,000: 68 s). The views
    proven over the budget were not rendered (the test above), but the proof was a floor of the messages'
    contents alone: on messages of a few characters the template's role headers and added tokens are most of a
    view, the floor a fraction of it, so every view from the budget to many times it was rendered to be skipped
    (here 1,000 messages: 33 views fit; b757769 rendered 310 views, to message 619, handing the template 193,509
    messages in 621 calls). Now the floor of a prompt counts the last turn's prompt up to the last user message
    exactly (``onepass.render.preskip``, the history floor): the template is handed what the views that fit need,
    prompt and full text, one view more and one prompt of every message (now 3,345 messages in 69 calls). The
    counter stops a render that hands the template 50,000 messages (the old code, early)."""
    messages = []
    for i in range(turns):
        messages += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    conv = parse_record({"messages": messages})
    render_conversation(parse_record({"messages": messages[:2]}), qwen3_tokenizer)  # the probes, outside the count
    handed = []
    real = template_module.apply_template

    def counting(tokenizer, msgs, **kw):
        handed.append(len(msgs))
        if sum(handed) > 50_000:
            raise _TooManyMessages(f"{len(handed)} template calls handed {sum(handed):,} messages")
        return real(tokenizer, msgs, **kw)

    monkeypatch.setattr(template_module, "apply_template", counting)
    rendered = render_conversation(conv, qwen3_tokenizer, max_tokens=max_tokens)
    monkeypatch.undo()
    kept = [v.turn for v in rendered.views if isinstance(v, View) and len(v) <= max_tokens]
    assert len(kept) > 20 and len(rendered.views) == turns and not rendered.skipped
    fit = sum(2 * k + 1 for k in kept)  # each view that fits: its prompt (k messages) and full text (k + 1)
    assert sum(handed) <= fit + 2 * len(messages), (sum(handed), fit, len(kept))
