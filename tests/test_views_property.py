"""View equivalence, as a property over random conversations and every schedule.

For every target at row position p, the tokens visible to p (by the rule
``k <= p < kv_end[k]``), ordered by position id, are exactly the view's tokens
before that target, with position ids 0..n-1; and every trained token of every
view appears as a target with its total weight (exactly once per view).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onepass.conversation import Conversation, Message, ToolCall
from onepass.pack import pack_layouts
from onepass.render import render_views
from onepass.schedule import parse_schedule, schedule_views
from onepass.tree import IGNORE

TOOLS = ({"type": "function", "function": {"name": "calc", "description": "evaluate",
                                           "parameters": {"type": "object",
                                                          "properties": {"expr": {"type": "string"}}}}},)

text = st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="<>"),
               max_size=40)
long_text = st.one_of(text, text.map(lambda s: (s + " ") * 30))
reasoning = st.one_of(st.just(""), text, long_text)


@st.composite
def conversations(draw):
    system = draw(st.one_of(st.none(), text))
    use_tools = draw(st.booleans())
    messages = []
    for _ in range(draw(st.integers(1, 16))):
        messages.append(Message(role="user", content=draw(long_text)))
        if use_tools and draw(st.integers(0, 3)) == 0:  # a tool-call chain inside this turn
            calls = (ToolCall(name="calc", arguments={"expr": draw(text)}),)
            messages.append(Message(role="assistant", content=draw(st.sampled_from(["", "let me compute"])),
                                    reasoning=draw(reasoning), tool_calls=calls))
            messages.append(Message(role="tool", content=draw(text)))
        messages.append(Message(role="assistant", content=draw(long_text), reasoning=draw(reasoning)))
    return Conversation(messages=tuple(messages), system=system, tools=TOOLS if use_tools else ())


def visible_context(row, p):
    keys = np.flatnonzero((np.arange(len(row)) <= p) & (row.kv_end > p))
    order = np.argsort(row.position_ids[keys], kind="stable")
    return keys[order]


def row_pairs(rows):
    """(context tokens, target) -> total weight, from the rows alone."""
    pairs: Counter = Counter()
    for row in rows:
        for p in np.flatnonzero(row.targets != IGNORE):
            keys = visible_context(row, p)
            assert row.position_ids[keys].tolist() == list(range(len(keys)))
            assert keys[-1] == p
            pairs[(tuple(row.input_ids[keys].tolist()), int(row.targets[p]))] += float(row.weights[p])
    return pairs


def view_pairs(views):
    pairs: Counter = Counter()
    for v in views:
        t = v.tokens.tolist()
        for i in range(max(v.num_prompt, 1), len(t)):
            pairs[(tuple(t[:i]), t[i])] += 1.0
    return pairs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                               HealthCheck.data_too_large])
@given(conv=conversations(), extra=st.integers(0, 200), k=st.integers(1, 6))
def test_every_target_sees_exactly_its_view(qwen3_tokenizer, conv, extra, k):
    views = render_views(conv, qwen3_tokenizer)
    assert len(views) == conv.num_assistant_turns
    expected = view_pairs(views)
    max_tokens = max(len(v) for v in views) + extra
    for spec in ("n-pass", "one-pass", f"k-pass:{k}", "budget"):
        out = schedule_views(views, parse_schedule(spec), max_tokens=max_tokens if spec == "budget" else None)
        assert not out.skipped
        assert row_pairs(out.layouts) == expected, spec
        if spec == "one-pass":
            assert sum(len(x) for x in out.layouts) <= sum(len(v) for v in views)
        if spec == "budget":
            assert all(len(x) <= max_tokens for x in out.layouts)
            packed = pack_layouts(out.layouts, max_tokens)
            assert row_pairs(packed) == expected
