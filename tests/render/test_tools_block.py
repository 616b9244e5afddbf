"""Tools rendered once per distinct value (onepass.render.tools_block) give the template's own text.

The substitution must be invisible: on every vendored template (those that allow it and those that
do not), over the tool-chain conversations and the real agent data, every rendered prompt and
conversation equals the plain ``apply_chat_template`` call; a template that reads ``tools`` anywhere
but its one loop is rendered as it is; a block whose first render disagrees with the plain one is
retired.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest

import onepass.render.tools_block as tb
from onepass.conversation.parse import parse_record
from onepass.render.template import apply_template
from onepass.render.messages import template_messages, template_tools
from onepass.prepare.template_report import tool_chain_conversations

sys.path.insert(0, str(Path(__file__).parents[1]))
from test_real_templates import CASES, chat_template  # noqa: E402

AGENT = Path(__file__).resolve().parents[3] / "shared" / "data" / "agent"
TEMPLATES = sorted({c.template for c in CASES})


def agent_conversations(n=3):
    out = []
    for name in ("taubench_airline", "bfcl_base_reasoning"):
        path = AGENT / f"{name}.jsonl"
        if path.exists():
            lines = path.read_text(encoding="utf-8").splitlines()
            out += [parse_record(json.loads(line), source=name, index=i) for i, line in
                    enumerate(itertools.islice(lines[::40], n))]
    return out


def renders(tok, conv):
    """Every prompt and conversation the views of ``conv`` need, through apply_template."""
    out = []
    tools = template_tools(conv)
    for k in range(1, len(conv.messages) + 1):
        for generation in (True, False):
            try:
                out.append(apply_template(tok, template_messages(conv, k), tools=tools,
                                          kwargs={"add_generation_prompt": generation}))
            except Exception as e:  # the template refuses this prefix: it must refuse it the same way
                out.append(f"raised {type(e).__name__}: {e}")
    return out


@pytest.mark.parametrize("name", TEMPLATES)
def test_every_render_equals_the_plain_template(qwen3_tokenizer, name, monkeypatch):
    template = chat_template(name)
    before = qwen3_tokenizer.chat_template
    qwen3_tokenizer.chat_template = template
    try:
        convs = tool_chain_conversations() + agent_conversations(1)
        got = [renders(qwen3_tokenizer, c) for c in convs]
        monkeypatch.setattr(tb, "allows", lambda _t: False)  # the plain call everywhere
        want = [renders(qwen3_tokenizer, c) for c in convs]
    finally:
        qwen3_tokenizer.chat_template = before
    assert got == want


def test_the_qwen3_template_takes_the_stand_in_and_gets_the_same_views(qwen3_tokenizer, monkeypatch):
    from onepass.render import render_conversation

    assert tb.allows(qwen3_tokenizer.chat_template)
    calls = []
    original = tb.render_with
    monkeypatch.setattr("onepass.render.template.render_with",
                        lambda *a, **k: (calls.append(1), original(*a, **k))[1])
    convs = agent_conversations()
    fast = [render_conversation(c, qwen3_tokenizer).views for c in convs]
    assert len(calls) > 10  # the stand-in path ran
    monkeypatch.setattr(tb, "allows", lambda _t: False)
    plain = [render_conversation(c, qwen3_tokenizer).views for c in convs]
    assert [[v.tokens.tolist() for v in vs] for vs in fast] == [[v.tokens.tolist() for v in vs] for vs in plain]


@pytest.mark.parametrize("template,allowed", [
    ("{% for tool in tools %}{{ tool | tojson }}{% endfor %}{{ messages[0].content }}", True),
    ("{% if tools and tools | length > 0 %}{% for t in tools %}{{ t.function.name }}{{ loop.index }}{% endfor %}"
     "{% endif %}", True),
    ("{% if tools is defined and tools %}{% for t in tools %}{% set x = t.function %}{{ x.name }}{% endfor %}"
     "{% endif %}", True),
    ("{{ tools }}", False),  # the list itself in the output
    ("{{ tools or 'none' }}", False),  # `or` returns the list
    ("{% for t in tools %}{{ t }}{% endfor %}{% for t in tools %}{{ t.function.name }}{% endfor %}", False),
    ("{% for m in messages %}{% for t in tools %}{{ t }}{% endfor %}{% endfor %}", False),  # once per message
    ("{% for t in tools %}{{ messages[0].content }}{{ t }}{% endfor %}", False),  # the body reads messages
    ("{% set ns = namespace(n=0) %}{% for t in tools %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}", False),
    ("{% for t in tools %}{{ t }}{% else %}none{% endfor %}", False),
    ("{{ tools[0].function.name }}", False),
    ("{% generation %}x{% endgeneration %}", False),  # a tag the plain parser does not know
])
def test_which_templates_allow_it(template, allowed):
    assert tb.allows(template) is allowed


def test_a_block_whose_first_render_differs_is_retired(qwen3_tokenizer, monkeypatch):
    conv = agent_conversations(1)[0]
    tools = template_tools(conv)
    messages = template_messages(conv, 2)

    def render(messages, tools):
        return qwen3_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)

    monkeypatch.setattr(tb, "_blocks", type(tb._blocks)())
    block = tb.tools_block(qwen3_tokenizer, qwen3_tokenizer.chat_template, tools, render)
    assert block is not None and not block.checked
    block.text = block.text + " "  # as if the block depended on something else
    assert tb.render_with(block, messages, tools, render) == render(messages, tools)
    assert block.checked and not block.usable and tb.tools_block(qwen3_tokenizer, qwen3_tokenizer.chat_template, tools, render) is None
